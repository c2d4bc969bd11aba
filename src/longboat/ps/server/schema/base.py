"""What every request is: ``Request`` (parsed from a ``Message``), and ``ServerView``, what a
request's ``check(state)`` reads of the server's state."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar, Protocol, TypeVar

from longboat.ps.server.blocks import DenseBlock
from longboat.ps.server.tables import Table
from longboat.ps.shared.request import RequestError
from longboat.ps.shared.wire import Message

MAX_TRAINERS = 1 << 16  # trainers of one job (the servers keep per-trainer records)

_Req = TypeVar("_Req", bound="Request")


class ServerView(Protocol):
    """What the requests' checks read of a server's state (``ServerState``)."""

    @property
    def index(self) -> int: ...
    @property
    def num_servers(self) -> int: ...
    @property
    def trainers(self) -> int: ...  # the job's trainers (0: not known yet)
    @property
    def digest(self) -> str: ...
    @property
    def blocks(self) -> Mapping[str, DenseBlock]: ...
    @property
    def tables(self) -> Mapping[str, Table]: ...


def _trainer_in(state: ServerView, trainer: int, field: str = "trainer") -> None:
    """``trainer`` is one of the job's (any index below 1 before the job's size is known)."""
    limit = max(state.trainers, 1)
    if not 0 <= trainer < limit:
        raise RequestError(f"{field!r} must be in [0, {limit}) (the job's trainers), got {trainer}")


class Request:
    """A parsed request; ``of`` takes one or parses a ``Message``."""

    method: ClassVar[str]

    @classmethod
    def parse(cls: type[_Req], msg: Message) -> _Req:
        raise NotImplementedError

    @classmethod
    def of(cls: type[_Req], msg: Message | Request) -> _Req:
        if isinstance(msg, cls):
            return msg
        if not isinstance(msg, Message):
            raise TypeError(f"a {cls.method} request is a Message, not a {type(msg).__name__}")
        return cls.parse(msg)

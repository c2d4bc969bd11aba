"""A parameter-server trainer on the timeline (``lb.ps.distribute`` with ``Strategy.timeline``).

Lanes of the trainer's process (``pid`` = trainer index, merged like the collective ranks):

- ``ps``: every call to a server, from send to reply: ``push s1``, ``pull s0``, ``barrier s0``,
  ``push+pull s1`` (a sync step's last push, answered with the next values once every trainer
  pushed) ... with ``server``, ``bytes`` (request for a push, reply for a pull), ``step``,
  ``keys``.
  Calls in flight at the same time (one per server and chunk, pulls overlapping the next
  forward) go to ``ps1``, ``ps2``, ...: each lane holds one call at a time, so its spans never
  overlap and every span is exactly one call's send-to-reply time.
- ``compute``: ``forward``, ``backward`` (from the output's first gradient to ``step()``) and the
  trainer's blocked waits ``wait push`` / ``wait pull`` / ``wait barrier`` / ``wait send queue``.
- ``optimizer``: ``optimizer step`` (the whole PS step: pushes, pulls, and the trainer-side
  optimizer when it runs there, nested as ``local optimizer``).
"""

from __future__ import annotations

import contextlib
import multiprocessing.util
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from longboat.trace import observer as _observer
from longboat.trace.config import TraceConfig
from longboat.trace.recorder import Recorder
from longboat.trace.stall import shown


def ps_lane(k: int) -> str:
    """The k-th lane for calls in flight at once: ``ps``, ``ps1``, ``ps2``, ..."""
    return "ps" if k == 0 else f"ps{k}"


class PSObserver:
    """Records one trainer's calls, forward/backward, waits and steps."""

    def __init__(self, recorder: Recorder, step: Callable[[], int]) -> None:
        self.recorder = recorder
        self._step = step
        self._lock = threading.Lock()
        self._busy: list[bool] = []  # per ps lane: a call in flight on it
        self._forward_start = 0.0
        self._backward_start: float | None = None
        self._closed = False
        _observer.make_current(self)  # lb.trace.data() records here
        multiprocessing.util.Finalize(self, self.close, exitpriority=20)

    # -- calls (Client.start) -------------------------------------------------------------------

    def started(self, call: Any, nbytes: int) -> None:
        """``call`` was just sent (``nbytes`` on the wire); record it when its reply arrives."""
        rec = self.recorder
        with self._lock:
            lane = next((k for k, busy in enumerate(self._busy) if not busy), len(self._busy))
            if lane == len(self._busy):
                self._busy.append(True)
                rec.add_lane(ps_lane(lane))
            self._busy[lane] = True
            start = rec.now()
        args: dict[str, Any] = {"server": call.server, "step": self._step()}
        keys = call.keys()
        if keys:
            args["keys"] = f"{len(keys)}: {shown(keys)}"
        method = call.method if call.waits_as()[0] == call.method else f"{call.method}+pull"

        def done(future: Any) -> None:
            end = rec.now()
            size = nbytes
            try:
                if method == "pull":
                    size = len(future.result())
            except Exception as exc:  # noqa: BLE001 - recorded, raised to the trainer elsewhere
                args["error"] = type(exc).__name__
            args["bytes"] = size
            rec.complete(ps_lane(lane), f"{method} s{call.server}", start, end, "ps", args)
            with self._lock:
                self._busy[lane] = False

        call._future.add_done_callback(done)

    # -- forward, backward, waits, step (PSModel, PSOptimizer, PSEngine) ------------------------

    def forward_begin(self) -> None:
        self._forward_start = self.recorder.now()
        self._backward_start = None

    def forward_end(self, output: Any) -> None:
        rec = self.recorder
        step = self._step()
        rec.complete("compute", "forward", self._forward_start, rec.now(), args={"step": step})
        for t in tree_leaves(output):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(self._backward_began)
                break

    def _backward_began(self, grad: torch.Tensor) -> None:
        if self._backward_start is None:
            self._backward_start = self.recorder.now()

    @contextlib.contextmanager
    def step(self, mode: str) -> Iterator[None]:
        """``optimizer.step()``: closes the backward span, records the whole step."""
        rec = self.recorder
        start = rec.now()
        if self._backward_start is not None:
            args = {"step": self._step()}
            rec.complete("compute", "backward", self._backward_start, start, args=args)
            self._backward_start = None
        args = {"step": self._step(), "mode": mode}
        try:
            yield
        finally:
            rec.complete("optimizer", "optimizer step", start, rec.now(), "step", args)

    def local_optimizer(self) -> contextlib.AbstractContextManager[None]:
        """The trainer-side optimizer (geo, or update_on_server=False), inside the step."""
        return self.recorder.span("optimizer", "local optimizer", "optimizer")

    def wait(self, what: str) -> contextlib.AbstractContextManager[None]:
        """The trainer blocked on ``what`` (``push``, ``pull``, ``barrier``, ``send queue``)."""
        return self.recorder.span("compute", f"wait {what}", "wait", step=self._step())

    def close(self) -> None:
        """Finish the timeline file (idempotent; also run at exit)."""
        if self._closed:
            return
        self._closed = True
        _observer.release(self)
        self.recorder.save()


def make_observer(
    config: TraceConfig, trainer: int, trainers: int, step: Callable[[], int]
) -> PSObserver | None:
    """The PS trainer's observer when ``config.timeline`` is set, else None."""
    if not config.timeline:
        return None
    return PSObserver(Recorder(config.timeline, trainer, trainers, 0), step)


class StallExplainer:
    """The stall warning of a PS trainer's unanswered call (``ReplyWatch``'s ``explain``): the
    server and endpoint, the method, the step and keys, and whom the server waits for.

    ``ask(server, question)`` asks that server which trainers it still lacks ([]: it cannot
    say); ``sync`` is whether the mode's servers combine every trainer's push per step.
    """

    def __init__(
        self,
        trainer: int,
        trainers: int,
        sync: bool,
        step: Callable[[], int],
        ask: Callable[[int, dict[str, Any]], list[Any]],
    ) -> None:
        self.trainer, self.trainers, self.sync = trainer, trainers, sync
        self._step, self._ask = step, ask

    def explain(self, call: Any, waited: float) -> str:
        """The warning for ``call``, unanswered after ``waited`` seconds."""
        method, meta = call.waits_as()
        others = [t for t in range(self.trainers) if t != self.trainer]
        whom = self.whom(call) or (
            f"trainer {others[0]}" if len(others) == 1 else f"one or more of trainers {others}"
        )
        if method == "pull" and int(meta.get("version", 0)) > 0 and self.sync:
            step = int(meta["version"]) - 1
            what = f"pull of step {step}"
            why = (
                f"it answers once every trainer's push of step {step} reached it; this trainer "
                f"({self.trainer}) pushed, so it waits for {whom}"
                if others
                else "this is the only trainer: the server is slow or stuck"
            )
        elif method in ("barrier", "restore") and others:
            what = f"{method} at step {self._step()}"
            why = (
                f"it answers once all {self.trainers} trainers reached it; this trainer "
                f"({self.trainer}) has, so it waits for {whom}"
            )
        else:
            step = int(meta.get("step", -1)) if method == "push" else -1
            what = f"push of step {step}" if step >= 0 else f"{method} at step {self._step()}"
            why = (
                f"a {method} does not wait for other trainers: the server is slow, stuck "
                "or unreachable"
            )
        return (
            f"trainer {self.trainer}: parameter server {call.server} ({call.endpoint}) has not "
            f"answered {what} for keys [{shown(call.keys())}] after {waited:.1f} s; {why}"
        )

    def whom(self, call: Any) -> str:
        """Ask the stalled call's server which trainers it still lacks ("" if it cannot say)."""
        method, meta = call.waits_as()
        if method == "barrier":
            question: dict[str, Any] = {"barrier": [meta.get("name", ""), meta.get("generation")]}
        elif method == "pull":
            asked = call.msg.tensors if call.msg is not None and call.method == "pull" else {}
            tables = [n[:-4] for n in asked if n.endswith("@ids")]
            question = {"keys": meta.get("keys") or [], "tables": tables,
                        "version": meta.get("version", 0)}  # fmt: skip
        else:
            return ""
        lacking = self._ask(call.server, question)
        if not lacking:
            return ""
        names = ", ".join(str(t) for t in lacking)
        return f"trainer{'s' if len(lacking) > 1 else ''} {names} (the server says)"

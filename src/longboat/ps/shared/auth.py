"""The per-job token every parameter-server request carries (gRPC metadata, constant-time check).

The launcher generates one token per job and hands it to every rank through a 0600 file
(``LONGBOAT_PS_TOKEN_FILE``) or the environment (``LONGBOAT_PS_TOKEN``). Servers refuse any
request whose token differs; clients send it with every call.
"""

from __future__ import annotations

import hmac
import os
import secrets
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path

TOKEN_ENV = "LONGBOAT_PS_TOKEN"
TOKEN_FILE_ENV = "LONGBOAT_PS_TOKEN_FILE"
METADATA_KEY = "x-longboat-token"


class AuthError(RuntimeError):
    """No usable token was configured."""


def generate_token() -> str:
    """A fresh random token (256 bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def write_token_file(path: str | os.PathLike[str], token: str) -> Path:
    """Write ``token`` to ``path`` readable by the owner only (0600); return the path."""
    target = Path(path)
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    os.chmod(target, 0o600)
    return target


def job_token_file(directory: str | os.PathLike[str]) -> str:
    """Create ``<directory>/.ps-token-<random>`` (0600) holding a fresh token; return its path."""
    os.makedirs(directory, exist_ok=True)
    path = Path(directory, f".ps-token-{secrets.token_hex(4)}").absolute()
    return str(write_token_file(path, generate_token()))


def load_token(env: Mapping[str, str] | None = None) -> str:
    """The job's token from ``LONGBOAT_PS_TOKEN`` or the file named by ``LONGBOAT_PS_TOKEN_FILE``."""
    env = os.environ if env is None else env
    if env.get(TOKEN_ENV):
        return env[TOKEN_ENV]
    path = env.get(TOKEN_FILE_ENV)
    if not path:
        raise AuthError(
            f"no parameter-server token: set {TOKEN_ENV} or {TOKEN_FILE_ENV} (longboat launch "
            "--servers N sets one per job), or pass token= explicitly"
        )
    mode = os.stat(path).st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise AuthError(
            f"token file {path} is readable by others (mode {stat.filemode(mode)}); "
            f"run: chmod 600 {path}"
        )
    token = Path(path).read_text().strip()
    if not token:
        raise AuthError(f"token file {path} is empty")
    return token


def check(metadata: Sequence[tuple[str, str | bytes]] | None, token: str) -> bool:
    """Whether the call's metadata carries ``token`` (compared in constant time)."""
    for key, value in metadata or ():
        if key == METADATA_KEY:
            got = value.encode() if isinstance(value, str) else bytes(value)
            return hmac.compare_digest(got, token.encode())
    return False

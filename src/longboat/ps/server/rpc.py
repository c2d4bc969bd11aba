"""A parameter server process: gRPC (generic handlers, raw-bytes frames) around ``ServerState``.

    lb.ps.run_server()            # in a PSERVER rank of `longboat launch --servers N`
    python -m longboat.ps.server --endpoint 127.0.0.1:7000 --index 0 --servers 2

Every call must carry the job's token, checked when the call starts, before its body is read
(``guard.TokenGate``); what callers may hold is bounded (``limits.ServerLimits``); frames are
size-bounded, and each request is read by its validator (``schema``) before anything is
applied: a malformed one is INVALID_ARGUMENT naming the field and changes nothing. Waits inside
a call end at the call's deadline, or when the server stops. Binds 127.0.0.1 unless told
otherwise.

A server process ends on SIGTERM/SIGINT within about ``STOP_GRACE_S`` seconds: the calls in
progress are answered UNAVAILABLE, and the process ends by the signal it got.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from longboat.cluster.env import variable
from longboat.log import get_logger
from longboat.ps.server import checkpoint, guard, schema
from longboat.ps.server.limits import ServerLimits
from longboat.ps.server.state import ServerState
from longboat.ps.shared import auth, wire
from longboat.ps.shared.request import Closing, RequestError, StaleStep
from longboat.ps.shared.service import METHODS, SERVICE, max_message_bytes
from longboat.ps.shared.wire import Message, WireError

log = get_logger("longboat.ps")

MAX_WAIT_S = 600.0
STOP_GRACE_S = 1.0  # a stopping server's calls in progress may finish this long
CHECKPOINT_DIR_ENV = "LONGBOAT_PS_CHECKPOINT_DIR"
CHECKPOINT_EVERY_ENV = "LONGBOAT_PS_CHECKPOINT_EVERY"


class CallError(Exception):
    """How a call fails: the gRPC status ``code`` and the ``details`` its caller reads."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class Server:
    """Server ``index`` of ``num_servers`` listening on ``endpoint`` (port 0: any free port)."""

    def __init__(
        self,
        endpoint: str = "127.0.0.1:0",
        *,
        index: int = 0,
        num_servers: int = 1,
        token: str,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        checkpoint_every: int = 0,
        max_bytes: int | None = None,
        limits: ServerLimits | None = None,
    ) -> None:
        """``limits``: what callers may hold (default: ``ServerLimits.from_env()``)."""
        if not 0 <= index < num_servers:
            raise ValueError(f"server index {index} is not in [0, {num_servers})")
        if not token:
            raise ValueError("a parameter server needs a non-empty token")
        self.index, self.num_servers, self._token = index, num_servers, token
        self.max_bytes = max_bytes or max_message_bytes()
        self.limits = limits or ServerLimits.from_env()
        self.state = ServerState(index, num_servers, trainer_timeout=self.limits.trainer_timeout_s)
        self._liveness = threading.Event()  # set: stop the liveness thread
        self._liveness_thread = threading.Thread(
            target=self._watch_trainers, name=f"lb-ps-liveness-{index}", daemon=True
        )
        self.boot = secrets.token_hex(8)
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir else None
        self.checkpoint_every = checkpoint_every
        self._restores: dict[tuple[int, int], set[int]] = {}
        self._stopped: set[int] = set()
        self.finished = threading.Event()  # set once every trainer said stop (fleet.stop_worker)
        self._restored: set[tuple[int, int]] = set()
        self.restored_step: int | None = None
        self._saved_step: int | None = None  # the step whose checkpoint this state wrote
        if self.checkpoint_dir is not None:
            saved = checkpoint.load(self.checkpoint_dir, index)
            if saved is not None:
                self.state.load_state_dict(saved, self.checkpoint_dir)
                self.restored_step = self.state.version()
                log.info(
                    "server %d restored from %s at step %d",
                    index,
                    self.checkpoint_dir,
                    self.restored_step,
                )
            if checkpoint_every > 0:
                self.state.on_version = self._periodic_save
        host, _, _ = endpoint.rpartition(":")
        if host in ("0.0.0.0", "[::]", ""):
            log.warning(
                "server %d listens on all interfaces (%s); anyone who can reach this "
                "host and holds the job token can update the model",
                index,
                endpoint,
            )
        self._methods: dict[str, Callable[[Any, float], Message | bytes]] = {
            m: getattr(self, f"_do_{m}") for m in METHODS
        }
        self._alarms = guard.Alarms()
        self.gate = guard.TokenGate(
            token,
            f"parameter server {index}: wrong or missing job token "
            f"(set {auth.TOKEN_ENV} or {auth.TOKEN_FILE_ENV} to the job's)",
            f"parameter server {index}",
        )
        handlers = {m: self._handler(m) for m in METHODS}
        # one worker per admitted call: a call never queues behind calls that wait (sync
        # steps, barriers), and a refused one is answered at once
        self._grpc = grpc.server(
            futures.ThreadPoolExecutor(self.limits.max_calls, thread_name_prefix="lb-ps"),
            handlers=[grpc.method_handlers_generic_handler(SERVICE, handlers)],
            interceptors=[self.gate],
            options=self.limits.grpc_options(self.max_bytes),
            maximum_concurrent_rpcs=self.limits.max_calls,
        )
        port = self._grpc.add_insecure_port(endpoint)
        if port == 0:
            raise OSError(f"parameter server {index} could not listen on {endpoint} (in use?)")
        self.endpoint = f"{host}:{port}"

    def start(self) -> Server:
        self._grpc.start()
        self._liveness_thread.start()
        log.info(
            "parameter server %d of %d listening on %s", self.index, self.num_servers, self.endpoint
        )
        return self

    def stop(self, grace: float | None = 0) -> None:
        """Stop serving: the waits of calls in progress end at once (UNAVAILABLE), then gRPC
        gives the calls ``grace`` seconds before cancelling them."""
        self._liveness.set()
        self.state.close()
        self._grpc.stop(grace).wait(10)
        self._alarms.close()
        if self._liveness_thread.is_alive():
            self._liveness_thread.join(10)

    def _watch_trainers(self) -> None:
        """Drop silent trainers (``ServerState.drop_silent``) every quarter of the timeout."""
        period = min(1.0, self.limits.trainer_timeout_s / 4)
        while not self._liveness.wait(period):
            try:
                self.state.drop_silent()
            except Exception:  # never end the watch: log and look again
                log.exception("server %d: the trainer liveness check failed", self.index)

    def wait(self) -> None:
        self._grpc.wait_for_termination()

    # ---- request plumbing ---------------------------------------------------------------
    def _handler(self, method: str) -> grpc.RpcMethodHandler:
        """A request-streaming handler (callers send one message): the wait for the body is
        bounded by ``limits.body_timeout_s``."""

        def handle(requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
            frame = guard.first_message(requests, context, self._alarms, self.limits.body_timeout_s)
            remaining = context.time_remaining()
            wait = min(MAX_WAIT_S, remaining if remaining is not None else MAX_WAIT_S)
            try:
                return self.answer(method, frame, time.monotonic() + wait)
            except CallError as exc:
                context.abort(exc.code, exc.details)
            raise AssertionError("unreachable")

        return grpc.stream_unary_rpc_method_handler(handle)

    def answer(self, method: str, frame: bytes | None, deadline: float) -> bytes:
        """The reply frame to ``frame``, or ``CallError`` with the status for the caller: a
        malformed or wrong request is INVALID_ARGUMENT naming the field, and changes nothing
        (``schema``: read, then checked against the state, before anything is applied)."""
        invalid = grpc.StatusCode.INVALID_ARGUMENT
        if frame is None:
            raise CallError(invalid, f"{method}: the call carried no request message")
        try:
            request = schema.parse(method, wire.decode(frame, self.max_bytes))
        except WireError as exc:
            raise CallError(invalid, f"{method}: malformed frame: {exc}") from None
        except RequestError as exc:
            raise CallError(invalid, f"{method}: {exc}") from None
        try:
            reply = self._methods[method](request, deadline)
            return reply if isinstance(reply, bytes) else wire.encode(reply)
        except StaleStep as exc:
            raise CallError(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from None
        except RequestError as exc:
            raise CallError(invalid, f"{method}: {exc}") from None
        except (WireError, KeyError, TypeError, ValueError) as exc:
            raise CallError(invalid, f"{method}: {type(exc).__name__}: {exc}") from None
        except Closing as exc:
            raise CallError(grpc.StatusCode.UNAVAILABLE, str(exc)) from None
        except TimeoutError as exc:
            raise CallError(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc)) from None
        except Exception as exc:
            log.exception("server %d: %s failed", self.index, method)
            raise CallError(
                grpc.StatusCode.INTERNAL,
                f"parameter server {self.index} failed {method}: {type(exc).__name__}: {exc} "
                "(a longboat bug; the server's log has the traceback)",
            ) from None

    # ---- methods: each takes its request as ``schema`` parsed it -----------------------------
    def _do_init(self, req: schema.Init, deadline: float) -> Message:
        held = (len(self.state.blocks), len(self.state.tables))
        reply = self.state.init(req)
        if self.checkpoint_every > 0:  # periodic checkpoints start with the initial values:
            with self.state.cond:  # a server lost before the first period restarts from them
                grew = (len(self.state.blocks), len(self.state.tables)) != held
                if grew and self.state.version() == 0:
                    self._saved_step = None  # values arrived since an earlier init's save
                    self._save(0)
        return reply

    def _do_push(self, req: schema.Push, deadline: float) -> Message | bytes:
        """Apply the push; with a ``pull`` entry (the trainer's last push of a step) answer
        with that pull's reply once it is ready, saving the trainer a call (the entry is
        checked with the push: a bad one is refused before the push applies)."""
        reply = self.state.push(req, deadline)
        return reply if req.pull is None else self.state.pull(req.pull, deadline)

    def _do_pull(self, req: schema.Pull, deadline: float) -> bytes:
        return self.state.pull(req, deadline)

    def _do_barrier(self, req: schema.Barrier, deadline: float) -> Message:
        return self.state.barrier(req, deadline)

    def _do_join(self, req: schema.Join, deadline: float) -> Message:
        return self.state.join(req)

    def _do_configure(self, req: schema.Configure, deadline: float) -> Message:
        return self.state.configure(req)

    def _do_hello(self, req: schema.Hello, deadline: float) -> Message:
        """A connecting trainer's settings: see ``longboat.ps.trainer.settings``."""
        return self.state.hello(
            req, {"wire_version": wire.VERSION, "max_message_bytes": self.max_bytes}
        )

    def _do_stop(self, req: schema.Stop, deadline: float) -> Message:
        """A trainer is done; once all are (but those dropped and not back), ``finished`` is
        set and ``run_server`` returns."""
        with self.state.cond:
            req.check(self.state)
            self._stopped.add(req.trainer)
            if self.state.present() <= self._stopped:
                log.info("server %d: every trainer stopped", self.index)
                self.finished.set()
        return Message({"stopped": len(self._stopped)})

    def _do_ping(self, req: schema.Ping, deadline: float) -> Message:
        """Who this server is; with ``keys``/``tables``/``barrier`` (a stalled trainer asking)
        also ``waiting_for``: the trainers it still lacks for them (``ServerState.missing``)."""
        reply = {
            "index": self.index,
            "num_servers": self.num_servers,
            "boot": self.boot,
            "step": self.state.version(),
            "restored": self.restored_step,
        }
        if req.asks:
            reply["waiting_for"] = self.state.missing(req)
        if req.table_stats:
            reply["table_stats"] = self.state.table_stats()
        return Message(reply)

    def _do_save(self, req: schema.Save, deadline: float) -> Message:
        """Checkpoint the current step, once: every trainer may call ``lb.ps.save()`` at the
        same step, and the first call writes while the others find the step saved."""
        with self.state.cond:  # as the periodic save: no push changes the state meanwhile
            step = self.state.version()
            self._save(step)
        return Message({"step": step})

    def _do_restore(self, req: schema.Restore, deadline: float) -> Message:
        """Barrier of all trainers, then reload the checkpoint at ``step`` once."""
        if self.checkpoint_dir is None:
            raise RequestError(f"server {self.index} has no checkpoint directory to restore from")
        key = (req.generation, req.step)
        with self.state.cond:
            req.check(self.state)
            saved_steps = checkpoint.steps_saved(self.checkpoint_dir, self.index)
            if key not in self._restored and req.step not in saved_steps:
                raise RequestError(
                    f"'step': server {self.index} has no checkpoint of step {req.step} in "
                    f"{self.checkpoint_dir} (it has {saved_steps})"
                )
            if key not in self._restores:
                self.state.begin_rollback()  # pulls waiting now would wait for nothing
            self._restores.setdefault(key, set()).add(req.trainer)
            if (
                len(self._restores[key]) >= max(self.state.trainers, 1)
                and key not in self._restored
            ):
                saved = checkpoint.load(self.checkpoint_dir, self.index, req.step)
                if saved is None:
                    raise RequestError(f"server {self.index} has no checkpoint to restore")
                self.state.load_state_dict(saved, self.checkpoint_dir)
                self._saved_step = None  # the steps after this one will be trained anew
                self._restored.add(key)
                log.info("server %d rolled back to step %d", self.index, req.step)
            self.state.cond.notify_all()
            self.state._wait(
                lambda: key in self._restored,
                deadline,
                f"every trainer asking to restore step {req.step}",
            )
        return Message({"step": req.step})

    def _save(self, step: int) -> None:
        if self.checkpoint_dir is None:
            raise RequestError(
                f"server {self.index} was started without a checkpoint directory "
                f"(--checkpoint-dir or {CHECKPOINT_DIR_ENV})"
            )
        if step == self._saved_step:
            return  # another trainer's save, or the periodic one, wrote this step already
        path = checkpoint.save_streaming(self.checkpoint_dir, self.index, step, self.state)
        self._saved_step = step
        log.info("server %d saved step %d to %s", self.index, step, path)

    def _periodic_save(self, step: int) -> None:
        """Called under the state's lock when every sync block reached ``step``: the file is
        written before any trainer can pull that step (a consistent, durable snapshot)."""
        if step % self.checkpoint_every == 0:
            self._save(step)


def run_server(endpoint: str | None = None, **settings: Any) -> None:
    """Serve until every trainer has stopped (``fleet.stop_worker``, ``kvstore`` close) or the
    process is terminated. ``settings`` are ``make_server``'s (index, num_servers, token,
    checkpoint_dir, checkpoint_every, env); unset ones come from the launcher's environment
    (PADDLE_PORT / PADDLE_PSERVERS_IP_PORT_LIST / LONGBOAT_ROLE_RANK / the job token)."""
    serve_until_done(make_server(endpoint, **settings).start())


def make_server(
    endpoint: str | None = None,
    *,
    index: int | None = None,
    num_servers: int | None = None,
    token: str | None = None,
    checkpoint_dir: str | None = None,
    checkpoint_every: int | None = None,
    env: dict[str, str] | None = None,
) -> Server:
    """A (not yet started) Server configured from arguments, falling back to ``env``."""
    env = dict(os.environ) if env is None else env
    servers = [e for e in env.get("PADDLE_PSERVERS_IP_PORT_LIST", "").split(",") if e]
    if endpoint is None:
        endpoint = f"127.0.0.1:{env['PADDLE_PORT']}" if "PADDLE_PORT" in env else "127.0.0.1:0"
        if env.get("POD_IP") and env.get("POD_IP") != "127.0.0.1" and "PADDLE_PORT" in env:
            endpoint = f"{env['POD_IP']}:{env['PADDLE_PORT']}"
    if index is None:
        index = variable("LONGBOAT_ROLE_RANK", env)
        if index is None:
            index = int(env.get("PADDLE_PSERVER_ID", "0"))
    if num_servers is None:
        num_servers = len(servers) or 1
    every = (
        checkpoint_every
        if checkpoint_every is not None
        else int(env.get(CHECKPOINT_EVERY_ENV, "0"))
    )
    return Server(
        endpoint,
        index=index,
        num_servers=num_servers,
        token=token or auth.load_token(env),
        checkpoint_dir=checkpoint_dir or env.get(CHECKPOINT_DIR_ENV) or None,
        checkpoint_every=every,
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m longboat.ps.server", description=__doc__)
    p.add_argument("--endpoint", default=None, help="host:port to listen on (127.0.0.1:0)")
    p.add_argument("--index", type=int, default=None, help="this server's index")
    p.add_argument("--servers", type=int, default=None, help="number of servers in the job")
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=None, help="save every N sync steps")
    p.add_argument("--port-file", default=None, help="write the bound endpoint here once up")
    a = p.parse_args(argv)
    server = make_server(
        a.endpoint,
        index=a.index,
        num_servers=a.servers,
        checkpoint_dir=a.checkpoint_dir,
        checkpoint_every=a.checkpoint_every,
    )
    server.start()
    if a.port_file:
        tmp = Path(a.port_file + ".tmp")
        tmp.write_text(server.endpoint)
        tmp.replace(a.port_file)
    serve_until_done(server)


def serve_until_done(server: Server) -> None:
    """Block until every trainer stopped, then stop the server and return; or, on SIGTERM or
    SIGINT (in the main thread), stop it and end the process by that signal.

    A signal ends the process rather than returning: an interpreter exit would first wait for
    every thread the job started, gRPC's included, and a launcher that sent SIGTERM would
    have to kill the server (``longboat launch`` waits 30 s before SIGKILL)."""
    got: list[int] = []
    stop = threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, _: (got.append(signum), stop.set()))
    while not stop.wait(0.2) and not server.finished.is_set():
        pass
    server.stop(STOP_GRACE_S)
    if got:
        _end_by_signal(got[0], server.index)


def _end_by_signal(signum: int, index: int) -> None:
    """End this process by ``signum`` (its default action) once the logs are flushed."""
    log.info("parameter server %d stopped by %s", index, signal.Signals(signum).name)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    time.sleep(5)  # the signal ends the process (delivered at once to the main thread)
    os._exit(128 + signum)


if __name__ == "__main__":
    main()

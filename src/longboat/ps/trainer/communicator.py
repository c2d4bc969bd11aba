"""Trainer-side background communication: the async/half-async send queue (Paddle's
communicator: ``max_merge_var_num``, ``send_queue_size``, ``send_wait_times``) and the backward-
hook pusher that starts a bucket's pushes as soon as its gradients are ready."""

from __future__ import annotations

import contextlib
import queue
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from longboat.log import get_logger

log = get_logger("longboat.ps")
WAIT_S = 0.005  # one of Paddle's "send_wait_times" waits for more gradients to merge


class AsyncCommunicator:
    """A thread that takes queued gradient sets, merges (averages) up to ``max_merge`` of them
    and hands the result to ``send``. Errors surface on the next ``put`` or ``flush``."""

    def __init__(
        self,
        send: Callable[[list[torch.Tensor]], None],
        *,
        max_merge: int,
        queue_size: int,
        wait_times: int,
        timeout: float,
    ) -> None:
        self._send, self._max_merge, self._wait_times = send, max_merge, wait_times
        self._timeout, self._queue_size = timeout, queue_size
        self._queue: queue.Queue[list[torch.Tensor] | None] = queue.Queue()
        self._idle = threading.Condition()
        self._busy = 0
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="lb-ps-communicator", daemon=True)
        self._thread.start()

    def put(self, grads: list[torch.Tensor]) -> None:
        """Queue one step's gradients (copies); block (bounded) while ``queue_size`` sets are
        queued or being sent, so a trainer's gradients are at most that many steps stale."""
        self._raise()
        copies = [g.clone() for g in grads]
        deadline = time.monotonic() + self._timeout
        with self._idle:
            while self._busy >= self._queue_size and self._error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"the parameter-server send queue stayed full for {self._timeout:.0f}s: "
                        "the communicator thread is not getting gradients to the servers"
                    )
                self._idle.wait(min(left, 1.0))
            self._busy += 1
        self._raise()
        self._queue.put(copies)

    def flush(self) -> None:
        """Wait until everything queued has been sent."""
        deadline = time.monotonic() + self._timeout
        with self._idle:
            while self._busy and self._error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"the communicator did not send the queued gradients in "
                        f"{self._timeout:.0f}s"
                    )
                self._idle.wait(min(left, 1.0))
        self._raise()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(self._timeout)

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            batch = [item]
            waits = 0
            while len(batch) < self._max_merge and waits < self._wait_times:
                try:
                    more = self._queue.get(timeout=WAIT_S)
                except queue.Empty:
                    waits += 1
                    continue
                if more is None:
                    self._queue.put(None)
                    break
                batch.append(more)
            try:
                if self._error is None:
                    merged = batch[0]
                    if len(batch) > 1:
                        merged = [torch.stack(gs).mean(0) for gs in zip(*batch, strict=True)]
                    self._send(merged)
            except BaseException as exc:  # surfaced to the trainer on its next call
                self._error = exc
            with self._idle:
                self._busy -= len(batch)
                self._idle.notify_all()


class HookPusher:
    """Pushes gradients from post-accumulate-grad hooks, bucket by bucket, on one thread.

    ``push(indices, last)`` is called (on the background thread) with the parameter indices of
    a bucket once all of them have their gradient, ``last`` true for the step's final bucket
    (the one that can carry the step's pull); it returns the calls it started.

    With ``tune`` the pusher times backward over steps 1 to ``TUNE_STEPS`` (step 0 is warm-up)
    and then merges every bucket whose push would start less than ``MIN_LEAD_S`` before
    ``finish()`` into the step's last bucket: such a push hides no transfer behind backward
    and only costs a call per server (many small layers, or a model whose backward is short).
    """

    TUNE_STEPS = 3
    MIN_LEAD_S = 0.004

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        push: Callable[[list[int], bool], list[Future]],
        bucket_bytes: int,
        tune: bool = True,
    ) -> None:
        self._push = push
        self.buckets: list[list[int]] = []
        current: list[int] = []
        size = 0
        for i in reversed(range(len(params))):  # backward produces the last layers first
            current.append(i)
            size += params[i].numel() * params[i].element_size()
            if size >= bucket_bytes:
                self.buckets.append(current)
                current, size = [], 0
        if current:
            self.buckets.append(current)
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="lb-ps-push")
        self._steps = 0
        self._leads: list[list[float]] | None = [] if tune and len(self.buckets) > 1 else None
        self._use(self.buckets)
        self._handles = [
            p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(params)
        ]

    def _use(self, buckets: list[list[int]]) -> None:
        self.buckets = buckets
        self._bucket_of = {i: b for b, idx in enumerate(buckets) for i in idx}
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self._missing = [set(b) for b in self.buckets]
            self._started: list[Future] = []
            self._sent = [False] * len(self.buckets)
            self._ready_at = [0.0] * len(self.buckets)
            self._twice = False

    def _hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(_: torch.Tensor) -> None:
            b = self._bucket_of[index]
            with self._lock:
                if self._sent[b] and index not in self._missing[b]:
                    self._twice = True  # a second backward: its gradients would be lost
                self._missing[b].discard(index)
                ready = not self._missing[b] and not self._sent[b]
                if ready:
                    self._submit(b)

        return hook

    def _submit(self, bucket: int) -> None:
        """Start bucket's push (the lock is held); the last of the step says so."""
        self._sent[bucket] = True
        self._ready_at[bucket] = time.perf_counter()
        last = all(self._sent)
        self._started.append(self._executor.submit(self._push, self.buckets[bucket], last))

    def finish(self) -> list[Future]:
        """Push the buckets no hook completed (unused parameters); return every started push."""
        now = time.perf_counter()
        with self._lock:
            leads = None  # measured only while tuning
            if self._leads is not None:
                leads = [now - t if sent else 0.0
                         for t, sent in zip(self._ready_at, self._sent, strict=True)]  # fmt: skip
            for b, sent in enumerate(self._sent):
                if not sent:
                    self._submit(b)
            started, twice = self._started, self._twice
        if leads is not None:
            self._tune(leads)
        self.reset()
        if twice:
            raise RuntimeError(
                "backward ran twice before optimizer.step(): with overlap the gradients are "
                "pushed during the first backward; call backward once per step, or pass "
                "overlap=False to lb.ps.distribute to push the accumulated gradients in step()"
            )
        return started

    def _tune(self, leads: list[float]) -> None:
        """Record a step's bucket leads; after the tuning steps merge the short ones."""
        self._steps += 1
        if self._leads is None or self._steps == 1:  # step 0 is warm-up
            return
        self._leads.append(leads)
        if len(self._leads) < self.TUNE_STEPS:
            return
        median = [statistics.median(column) for column in zip(*self._leads, strict=True)]
        self._leads = None
        keep = next((b for b, lead in enumerate(median) if lead < self.MIN_LEAD_S), len(median))
        if keep >= len(self.buckets) - 1:
            return
        merged = self.buckets[:keep] + [[i for b in self.buckets[keep:] for i in b]]
        log.info(
            "push buckets: %d -> %d (buckets ready less than %.0f ms before step() join the "
            "last; measured leads %s ms)",
            len(self.buckets),
            len(merged),
            self.MIN_LEAD_S * 1e3,
            ", ".join(f"{1e3 * lead:.1f}" for lead in median),
        )
        self._use(merged)

    def abandon(self) -> None:
        """Wait for the pushes already started (ignoring their errors) and forget this step."""
        with self._lock:
            started = self._started
        for f in started:
            with contextlib.suppress(Exception):
                for call in f.result():
                    with contextlib.suppress(Exception):
                        call.result()
        self.reset()

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._executor.shutdown(wait=True)

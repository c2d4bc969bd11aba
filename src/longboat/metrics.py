"""``lb.log_every(n)``: loss and throughput every n steps, without a per-step synchronisation.

    logger = lb.log_every(50, total=steps, samples_per_step=batch * lb.world_size())
    for step, (x, y) in enumerate(loader):
        loss = criterion(model(x), y)
        ...
        logger.step(loss)          # keeps the tensor: no .item(), no device sync
    logger.close()

``loss.item()`` on a GPU waits for every kernel queued so far, so calling it each step removes
the overlap of one step's tail with the next step's start (Paddle's collective-training guide:
"reduce the fetch frequency"). Here the detached loss tensors are kept and averaged with one
``.item()`` every ``n`` steps. Rank 0 shows a rich progress bar (or logs a line when not on a
terminal, with the time left when ``total`` is known) and, when ``tensorboard`` is given and TensorBoard is installed, writes ``loss`` and
``samples_per_s``. Values are this rank's: no collective is added.
"""

from __future__ import annotations

import time
from collections.abc import Sized
from typing import Any

import torch

from longboat.log import get_logger

log = get_logger("longboat.metrics")


class LogEvery:
    """See the module docstring; build it with `log_every`."""

    def __init__(
        self,
        n: int,
        *,
        total: int | Sized | None = None,
        samples_per_step: int | None = None,
        tensorboard: str | None = None,
        rank: int | None = None,
        description: str = "train",
    ):
        if n < 1:
            raise ValueError(f"log_every: n must be >= 1 step, got {n}")
        if rank is None:
            import longboat.cluster as cluster

            rank = cluster.rank() if cluster.is_initialized() else 0
        if total is not None and not isinstance(total, int):
            total = len(total)  # a DataLoader (or any sized iterable): one step per batch
        self.n = n
        self.total = total
        self.samples_per_step = samples_per_step
        self.steps = 0
        self.last: dict[str, float] = {}
        self._losses: list[torch.Tensor] = []
        self._window_start = time.perf_counter()
        self._main = rank == 0
        self._progress: Any = None
        self._task: Any = None
        self._writer: Any = None
        if self._main:
            self._start_progress(total, description)
            if tensorboard:
                self._writer = _tensorboard_writer(tensorboard)

    def _start_progress(self, total: int | None, description: str) -> None:
        from rich.console import Console

        from longboat.tools.progress import make_bar

        console = Console(stderr=True)
        if not console.is_terminal:
            return  # logs a line every n steps instead
        self._progress = make_bar(console, "{task.fields[metrics]}")
        self._task = self._progress.add_task(description, total=total, metrics="")
        self._progress.start()

    def step(self, loss: torch.Tensor | float | None = None) -> dict[str, float] | None:
        """Count one step (keeping ``loss`` without syncing); every n-th returns the metrics."""
        self.steps += 1
        if loss is not None:
            self._losses.append(
                loss.detach() if isinstance(loss, torch.Tensor) else torch.tensor(loss)
            )
        if self._progress is not None:
            self._progress.advance(self._task)
        if self.steps % self.n:
            return None
        return self._fetch(self.n)

    def _fetch(self, steps: int) -> dict[str, float]:
        now = time.perf_counter()
        elapsed = now - self._window_start
        self._window_start = now
        metrics = {"step": float(self.steps), "steps_per_s": steps / elapsed if elapsed else 0.0}
        if self._losses:
            losses = torch.stack([t.reshape(()).float() for t in self._losses])
            metrics["loss"] = float(losses.mean().item())  # the one sync per n steps
            self._losses.clear()
        if self.samples_per_step:
            metrics["samples_per_s"] = metrics["steps_per_s"] * self.samples_per_step
        if self.total is not None and metrics["steps_per_s"] > 0:
            metrics["eta_s"] = max(0, self.total - self.steps) / metrics["steps_per_s"]
        self.last = metrics
        if self._main:
            self._show(metrics)
        return metrics

    def _show(self, metrics: dict[str, float]) -> None:
        text = "  ".join(
            f"{key} {metrics[key]:{style}}" for key, style in _SHOWN if key in metrics
        )
        if self._progress is not None:
            self._progress.update(self._task, metrics=text)
        else:
            of = f"/{self.total}" if self.total is not None else ""
            eta = f"  eta {_clock(metrics['eta_s'])}" if "eta_s" in metrics else ""
            log.info("step %d%s: %s%s", self.steps, of, text, eta)
        if self._writer is not None:
            for key in ("loss", "samples_per_s"):
                if key in metrics:
                    self._writer.add_scalar(key, metrics[key], self.steps)

    def close(self) -> dict[str, float] | None:
        """Report the steps since the last fetch, stop the bar, flush TensorBoard."""
        leftover = self.steps % self.n
        result = self._fetch(leftover) if leftover else None
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        return result

    def __enter__(self) -> LogEvery:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: what a progress line shows, in order, and how: ``loss 0.4121  samples_per_s 5321  steps_per_s 83.14``
_SHOWN = (("loss", ".4f"), ("samples_per_s", ".0f"), ("steps_per_s", ".2f"))


def _clock(seconds: float) -> str:
    """``1:02:03`` / ``2:03``: a duration as a person reads it."""
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def _tensorboard_writer(log_dir: str) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        log.warning(
            "log_every(tensorboard=%r): TensorBoard is not installed; scalars are not written "
            "(pip install tensorboard)",
            log_dir,
        )
        return None
    return SummaryWriter(log_dir)


def log_every(n: int, **kwargs: Any) -> LogEvery:
    """Metrics every ``n`` steps without per-step synchronisation; see `LogEvery`."""
    return LogEvery(n, **kwargs)

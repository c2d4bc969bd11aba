"""`longboat demo`: train a small convnet on local ranks and check it against one process.

The ranks start through `launch_local` (torch's elastic agent), train on scikit-learn's digits
with `lb.distribute` and `lb.DistributedSampler`, and send back their final parameters. The
launcher then replays the same global batches in a single process and compares.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from longboat.tools.demo_methods import EXACT, METHODS
from longboat.words import plural

if TYPE_CHECKING:  # torch and the training code load only when the demo runs
    import torch

    from longboat.tools.demo_train import DemoConfig

RTOL, ATOL = 1e-5, 1e-6


@dataclass(frozen=True)
class Check:
    """Outcome of the comparisons: ranks agree with each other, rank 0 with the reference."""

    ranks_identical: bool
    ranks_max_diff: float
    reference_max_diff: float | None  # None: reference comparison skipped
    reference_match: bool | None

    @property
    def ok(self) -> bool:
        return self.ranks_identical and self.reference_match is not False


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=int, default=2, help="local ranks to start (default 2)")
    parser.add_argument("--epochs", type=int, default=6, help="training epochs (default 6)")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=64,
        help="global batch size, split evenly across ranks (default 64)",
    )
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (default 0.9)")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights and data order")
    parser.add_argument(
        "--method",
        default="baseline",
        choices=_method_names(),
        help="training method (a Strategy with one communication, precision or memory "
        "optimisation on; default baseline). baseline and sharding (ZeRO stage 2) are checked "
        "against single-process training; the others report accuracy and gradient bytes per "
        "step (compare them with benchmarks/compression_accuracy.py)",
    )
    parser.add_argument(
        "--no-check",
        action="store_true",
        help="skip the single-process reference run and its comparison",
    )


def _method_names() -> list[str]:
    return list(METHODS)


def run(args: argparse.Namespace) -> int:
    """Run the demo; 0 when training succeeded and every check passed, 1 otherwise."""
    from rich.console import Console

    from longboat.launch.local import LaunchError, launch_local
    from longboat.tools.demo_train import load_digits_split, train_rank, train_reference

    console = Console()
    try:
        cfg = _config(args)
    except ValueError as exc:
        console.print(f"[red]longboat demo: {exc}[/]")
        return 1
    start = time.perf_counter()
    console.print(headline(cfg))
    try:
        results = launch_local(train_rank, (cfg,), nproc=cfg.nproc)
    except LaunchError as exc:
        console.print(f"[red bold]longboat demo: training failed[/]\n{exc}")
        return 1
    exact = cfg.method in EXACT  # the other methods change the arithmetic on purpose
    checked = exact and not args.no_check
    reference = train_reference(cfg, load_digits_split()[0]) if checked else None
    check = compare(results, reference)
    console.print(report(cfg, results, reference, check, time.perf_counter() - start))
    return 0 if check.ok else 1


def headline(cfg: DemoConfig) -> str:
    """The demo's first line: what it runs."""
    return (
        f"longboat demo: {plural(cfg.nproc, 'rank')}, {plural(cfg.epochs, 'epoch')}, global batch "
        f"{cfg.global_batch} ({cfg.rank_batch} per rank), digits 8x8"
    )


def _config(args: argparse.Namespace) -> DemoConfig:
    from longboat.tools.demo_train import DemoConfig

    if args.nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {args.nproc}")
    if args.epochs < 1:
        raise ValueError(f"--epochs must be >= 1, got {args.epochs}")
    if args.batch_size < args.nproc or args.batch_size % args.nproc:
        raise ValueError(
            f"--batch-size {args.batch_size} must be a positive multiple of --nproc {args.nproc}"
        )
    return DemoConfig(
        args.nproc, args.epochs, args.batch_size, args.lr, args.momentum, args.seed, args.method
    )


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest element-wise |a - b| over all parameters (same names and shapes required)."""
    if a.keys() != b.keys():
        raise ValueError(f"parameter names differ: {sorted(a.keys() ^ b.keys())}")
    return max((a[k] - b[k]).abs().max().item() for k in a)


def compare(results: dict[int, dict[str, Any]], reference: dict[str, Any] | None) -> Check:
    """Every rank must hold rank 0's parameters exactly; rank 0 must match the reference."""
    import torch

    params0 = results[0]["params"]
    others = [results[r]["params"] for r in sorted(results) if r != 0]
    identical = all(all(torch.equal(params0[k], p[k]) for k in params0) for p in others)
    ranks_diff = max((max_abs_diff(params0, p) for p in others), default=0.0)
    if reference is None:
        return Check(identical, ranks_diff, None, None)
    ref = reference["params"]
    match = all(torch.allclose(params0[k], ref[k], rtol=RTOL, atol=ATOL) for k in ref)
    return Check(identical, ranks_diff, max_abs_diff(params0, ref), match)


def _mean_final_loss(results: dict[int, dict[str, Any]], steps: int) -> float:
    """Mean over ranks of their last ``steps`` batch losses (equal batch sizes on every rank)."""
    return sum(sum(r["losses"][-steps:]) / steps for r in results.values()) / len(results)


def report(
    cfg: DemoConfig,
    results: dict[int, dict[str, Any]],
    reference: dict[str, Any] | None,
    check: Check,
    wall_s: float,
) -> Any:
    """A rich table with the run's numbers and the verdict of the checks."""
    from rich.table import Table

    first = results[0]
    steps_per_epoch = len(first["losses"]) // cfg.epochs
    seconds = max(r["seconds"] for r in results.values())
    table = Table(title="longboat demo", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    table.add_row("ranks", f"{cfg.nproc} (local, via torch elastic agent)")
    table.add_row("backend", first["backend"])
    table.add_row("epochs", f"{cfg.epochs} ({plural(steps_per_epoch, 'step')} each)")
    table.add_row("global batch", f"{cfg.global_batch} ({cfg.rank_batch} per rank)")
    table.add_row("method", cfg.method)
    table.add_row("gradient bytes/step", f"{first['bytes_per_step']:,.0f} sent by rank 0")
    table.add_row("test accuracy", f"{first['accuracy']:.1%}")
    table.add_row("train loss, last epoch", f"{_mean_final_loss(results, steps_per_epoch):.4f}")
    table.add_row("samples/s distributed", f"{first['samples_per_s']:,.0f} ({seconds:.2f} s loop)")
    if reference is not None:
        table.add_row(
            "samples/s single-process",
            f"{reference['samples_per_s']:,.0f} ({reference['seconds']:.2f} s loop, 1 thread)",
        )
        single_step_ms = 1e3 * reference["seconds"] / max(len(first["losses"]), 1)
        table.add_row("why the speeds", speed_note(cfg.nproc, single_step_ms))
    table.add_row("wall time", f"{wall_s:.1f} s (start-up, training, check)")
    table.add_row("ranks identical", _ranks_verdict(check) if cfg.nproc > 1 else "n/a (1 rank)")
    table.add_row("match single-process", _reference_verdict(check))
    return table


def speed_note(nproc: int, single_step_ms: float, cores: int | None = None) -> str:
    """Why distributed samples/s here says little about a cluster: the ranks share this
    machine's cores, and a step of a model this small is mostly fixed per-step costs."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    where = f"{plural(nproc, 'rank')} on {plural(cores, 'core')}"
    return (
        f"{where}, and one step of this small model takes {single_step_ms:.1f} ms in one "
        "process, so the allreduce and Python around it are a large share of a step. This run "
        "checks correctness; measure speed with `longboat bench train` on your nodes"
    )


def _ranks_verdict(check: Check) -> str:
    if check.ranks_identical:
        return "[green]yes[/] (bitwise)"
    return f"[red]NO[/] (max |diff| between ranks = {check.ranks_max_diff:.3g})"


def _reference_verdict(check: Check) -> str:
    if check.reference_match is None:
        return "not checked (--no-check, or a method other than baseline and sharding)"
    diff = f"max |diff| = {check.reference_max_diff:.3g}"
    if check.reference_match:
        return f"[green]yes[/] ({diff})"
    return f"[red]NO[/] ({diff}, tolerance rtol={RTOL:g} atol={ATOL:g})"

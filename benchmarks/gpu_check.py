"""One command that checks longboat on a machine with a GPU, and prints one Markdown table.

    PYTHONPATH=src python benchmarks/gpu_check.py            # from a source checkout
    PYTHONPATH=src python benchmarks/gpu_check.py --parts equivalence,syncs --out results/

Needs nothing beyond torch (2.11 or newer, with CUDA) and longboat's own dependencies, and
prints how long each part took (run ``--parts ordering`` first on a short device lease). Parts:

* ``ordering``: every Strategy variant at 4 virtual ranks over the lagging test backend
  (``tests/_lagging_backend.py``): NCCL's stream semantics, with each collective's result
  landing only after a deliberate delay on its own stream, so a reader the stream does not
  order after the reduction reads stale gradients. Exact variants must equal a
  single-process run on the same batch; lossy ones the same virtual run on CPU tensors
  (host completion). A negative control (bucket handles replaced by host-completed futures,
  the defect this part exists to catch) must fail.
* ``equivalence``: 2 ranks sharing the GPU over Gloo with CUDA tensors, for every allreduce
  algorithm, compressor, AMP dtype, sync BN, gradient merge and local SGD. Exact settings
  must equal a single-process CUDA run on the global batch; lossy ones (compressed
  allreduce, PowerSGD, DGC, local SGD) the same 2-rank run on CPU tensors, which the CPU test
  suite proves against its references.
* ``syncs``: world-size-1 NCCL training steps under ``torch.cuda.set_sync_debug_mode``:
  ``error`` for settings that must never make the host wait for the GPU, and a count of
  warnings (at most one per step) for float16 loss scaling and find_unused_parameters.
* ``compile``: ``model.compile()`` (inductor, cut at longboat's buckets) against eager training
  at world size 1 on NCCL, and its steady-state steps under sync debug mode ``error``.
* ``overhead``: ``longboat bench train --device cuda --nproc 1`` on a ResNet-50-sized CNN and
  a GPT-2-small-sized transformer, fp32 and bf16 AMP: longboat against the plain loop, torch
  DDP at its defaults and DDP with ``broadcast_buffers=False, gradient_as_bucket_view=True``,
  11 interleaved rounds of one run, each ratio paired round by round. The NCCL allreduce is
  launched at world size 1 as at N (hooks, bucket copies, stream hand-offs): the path N GPUs
  take.
* ``launcher``: ``longboat launch`` starts an NCCL rank on this torch, and refuses more ranks
  than GPUs before any rank starts.
* ``tests``: the test suite's GPU tests (``pytest -m gpu``).

Exits non-zero if any check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests import _lagging_harness as lagging  # noqa: E402 - after the path tweak
from tests._dist import run_ranks  # noqa: E402

PARTS = ("ordering", "equivalence", "syncs", "compile", "overhead", "launcher", "tests")
STEPS = 6
GLOBAL_BATCH = 32
IN, CLASSES = lagging.IN, lagging.CLASSES

# name -> (Strategy fields, reference): "global" = single-process CUDA run on the global batch
EQUIVALENCE: dict[str, tuple[dict[str, Any], str]] = {
    "default": ({}, "global"),
    "native": ({"allreduce_algorithm": "native"}, "global"),
    "ring": ({"allreduce_algorithm": "ring"}, "global"),
    "shm": ({"allreduce_algorithm": "shm"}, "global"),
    "hierarchical": ({"allreduce_algorithm": "hierarchical"}, "global"),
    "3 communicators": ({"nccl_comm_num": 3, "fuse_grad_size_in_MB": 0.05}, "global"),
    "gradient merge k=2": (
        {"gradient_merge": True, "gradient_merge_configs": {"k_steps": 2, "avg": True}},
        "global",
    ),
    "sync batch norm": ({"sync_batch_norm": True}, "global"),
    "find_unused_parameters": ({"find_unused_parameters": True}, "global"),
    "amp bfloat16": ({"amp": True, "amp_configs": {"dtype": "bfloat16"}}, "global"),
    "amp float16": ({"amp": True, "amp_configs": {"dtype": "float16"}}, "global"),
    "fp16 allreduce": ({"fp16_allreduce": True}, "cpu"),
    "bf16 allreduce": ({"gradient_compression": "bf16"}, "cpu"),
    "powersgd": (
        {
            "gradient_compression": "powersgd",
            "powersgd_configs": {"rank": 2, "start_step": 2, "min_compression_bytes": 0},
        },
        "cpu",
    ),
    "dgc": ({"dgc": True, "dgc_configs": {"rampup_begin_step": 2}}, "cpu"),
    "local sgd k=2": ({"localsgd": True, "localsgd_configs": {"k_steps": 2}}, "cpu"),
}
TOLERANCE = {"global": 1e-5, "amp": 2e-3, "cpu": 1e-4}

# name -> (Strategy fields, host synchronisations allowed per step)
SYNCS: dict[str, tuple[dict[str, Any], int]] = {
    "default": ({}, 0),
    "3 communicators, 1 MB buckets": ({"nccl_comm_num": 3, "fuse_grad_size_in_MB": 1}, 0),
    "gradient merge k=2": ({"gradient_merge": True, "gradient_merge_configs": {"k_steps": 2}}, 0),
    "amp bfloat16": ({"amp": True, "amp_configs": {"dtype": "bfloat16"}}, 0),
    "fp16 allreduce": ({"fp16_allreduce": True}, 0),
    "bf16 allreduce": ({"gradient_compression": "bf16"}, 0),
    "sync batch norm": ({"sync_batch_norm": True}, 0),
    "amp float16 (overflow decision)": ({"amp": True, "amp_configs": {"dtype": "float16"}}, 1),
    "find_unused_parameters": ({"find_unused_parameters": True}, 1),
    "sharding stage 1": ({"sharding": True, "sharding_configs": {"stage": 1}}, 0),
    "sharding stage 2": ({"sharding": True, "sharding_configs": {"stage": 2}}, 0),
    **{  # comm_overlap: the gathers wait on the stream in the next forward's hooks
        f"sharding stage {stage}, gather in the next forward": (
            {"sharding": True, "sharding_configs": {"stage": stage, "comm_overlap": True}},
            0,
        )
        for stage in (1, 2)
    },
}

SYNC_WARNING = "called a synchronizing CUDA operation"  # torch's sync debug mode, "warn"

OVERHEAD = [
    ("resnet50", "fp32", {}),
    ("resnet50", "bf16 amp", {"amp": True, "amp_configs": {"dtype": "bfloat16"}}),
    ("gpt2-small", "fp32", {}),
    ("gpt2-small", "bf16 amp", {"amp": True, "amp_configs": {"dtype": "bfloat16"}}),
]


@dataclass
class Row:
    """One check: ``ok`` False fails the run; ``goal`` False marks a missed speed goal."""

    part: str
    check: str
    ok: bool
    result: str
    detail: str = ""
    goal: bool = True

    @property
    def status(self) -> str:
        if not self.ok:
            return "**FAILED**"
        return "yes" if self.goal else "goal missed"


# ---- models and data ---------------------------------------------------------------------------


Net = lagging.Net  # the same model as the ordering harness


def _data(steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(steps, GLOBAL_BATCH, IN, generator=g)
    return x, torch.randint(0, CLASSES, (steps, GLOBAL_BATCH), generator=g)


def _shard(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    per = t.shape[0] // world
    return t[rank * per : (rank + 1) * per]


def _build(name: str, seed: int, device: torch.device) -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Net(batch_norm="batch norm" in name, spare=name == "find_unused_parameters").to(device)
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


_micro_steps = lagging.merge_steps
_autocast = lagging.autocast_dtype
_params = lagging.params
_max_diff = lagging.max_diff


# ---- equivalence ---------------------------------------------------------------------------------


def _distributed_run(name: str, rank: int, world: int, device: torch.device) -> dict:
    import longboat as lb

    fields, _ = EQUIVALENCE[name]
    model, opt = _build(name, seed=rank, device=device)  # distribute broadcasts rank 0's
    dmodel, dopt = lb.distribute(model, opt, lb.Strategy(**fields))
    x, y = _data(STEPS * _micro_steps(fields))
    spare = name == "find_unused_parameters" and rank == 0  # used on one rank of two
    for i in range(x.shape[0]):
        dopt.zero_grad()
        xs, ys = _shard(x[i], rank, world).to(device), _shard(y[i], rank, world).to(device)
        F.cross_entropy(dmodel(xs, use_spare=spare), ys).backward()
        dopt.step()
    return _params(model)


def _equivalence_rank(rank: int, world: int, names: list[str], device: str) -> dict[str, Any]:
    """Each setting on ``device`` tensors and, for lossy ones, on CPU tensors: parameters."""
    import longboat as lb

    lb.init()
    out: dict[str, Any] = {}
    for name in names:
        try:
            cuda = _distributed_run(name, rank, world, torch.device(device))
            cpu = None
            if EQUIVALENCE[name][1] == "cpu":
                cpu = _distributed_run(name, rank, world, torch.device("cpu"))
            out[name] = {"cuda": cuda, "cpu": cpu}
        except Exception:  # noqa: BLE001 - reported in the table, the other settings go on
            out[name] = {"error": traceback.format_exc(limit=-3)}
    return out


def _global_reference(name: str, world: int, device: torch.device) -> dict[str, torch.Tensor]:
    """One process: every step averages the loss of the ranks' shards, as N ranks do."""
    fields, _ = EQUIVALENCE[name]
    model, opt = _build(name, seed=0, device=device)
    k = _micro_steps(fields)
    x, y = _data(STEPS * k)
    dtype = _autocast(fields)
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(k):
            i = step * k + micro
            with torch.autocast(device.type, dtype, enabled=dtype is not None):
                if name == "sync batch norm":  # one batch norm over the global batch
                    losses = [F.cross_entropy(model(x[i].to(device)), y[i].to(device))]
                else:
                    losses = [
                        F.cross_entropy(
                            model(
                                _shard(x[i], r, world).to(device),
                                use_spare=name == "find_unused_parameters" and r == 0,
                            ),
                            _shard(y[i], r, world).to(device),
                        )
                        for r in range(world)
                    ]
            (torch.stack(losses).mean() / k).backward()
        opt.step()
    return _params(model)


def check_equivalence(
    rows: list[Row], device: str = "cuda:0", names: list[str] | None = None
) -> None:
    """``device`` "cpu" runs the same comparison without a GPU (the suite checks the script)."""
    names = names or list(EQUIVALENCE)
    results = run_ranks(
        _equivalence_rank, 2, names, device, timeout=240, env={"LONGBOAT_BACKEND": "gloo"}
    )
    for name in names:
        fields, reference = EQUIVALENCE[name]
        ranks = [r[name] for r in results]
        failed = [r["error"] for r in ranks if "error" in r]
        if failed:
            rows.append(Row("equivalence", name, False, "error", failed[0].strip()[-300:]))
            continue
        apart = _max_diff(ranks[0]["cuda"], ranks[1]["cuda"])
        if reference == "cpu":
            diff = max(_max_diff(r["cuda"], r["cpu"]) for r in ranks)  # rank by rank
            what, tol = "2 ranks on CPU", TOLERANCE["cpu"]
        else:
            against = _global_reference(name, 2, torch.device(device))
            diff = _max_diff(ranks[0]["cuda"], against)
            what = "1 process, global batch"
            tol = TOLERANCE["amp" if fields.get("amp") else "global"]
        # local SGD lets the ranks drift between averagings; every other setting keeps them equal
        ok = diff <= tol and (apart == 0.0 or "local sgd" in name)
        rows.append(
            Row(
                "equivalence",
                name,
                ok,
                f"max diff {diff:.1e} (tol {tol:.0e})",
                f"vs {what}; ranks apart {apart:.1e}",
            )
        )


# ---- ordering: N virtual ranks with NCCL's stream semantics --------------------------------------


def check_ordering(rows: list[Row], device: str = "cuda:0") -> None:
    """Every variant through the lagging backend; see ``tests/_lagging_harness.py``.

    ``device`` "cpu" runs the same comparisons with host completion (the suite checks the
    script): there the negative control must match, since nothing lags."""
    lags = torch.device(device).type == "cuda"
    names = [*lagging.VARIANTS, lagging.CONTROL, lagging.NEGATIVE]
    (gpu,) = run_ranks(lagging.run_all, 1, device, names, timeout=300)
    lossy = [n for n, (_, against) in lagging.VARIANTS.items() if against == "host"]
    (host,) = run_ranks(lagging.run_all, 1, "cpu", lossy, timeout=300)
    for name in names:
        result = gpu[name]
        if name == lagging.NEGATIVE and lags and lagging.STALE_SYMPTOM in result.get("error", ""):
            # the usage counts ride the same unordered handles: read stale, they claim
            # parameters got no gradient. The defect shows; the control did its job.
            rows.append(Row("ordering", name, True, "raised on stale usage counts", "must fail"))
            continue
        if "error" in result:
            rows.append(Row("ordering", name, False, "error", result["error"].strip()[-300:]))
            continue
        if name == lagging.CONTROL:
            rows.append(Row("ordering", name, True, result["control"]))
            continue
        against = lagging.VARIANTS.get(name, ({}, "single"))[1]
        if against == "host":
            if "error" in host[name]:
                rows.append(Row("ordering", name, False, "host run failed", host[name]["error"]))
                continue
            reference, what = host[name]["run"], "the same virtual run on CPU"
        else:
            reference = lagging.single_reference(name, torch.device(device))
            what = "1 process, same batch"
        tol = lagging.tolerance(name, against)
        diff = lagging.max_diff(result["run"], reference)
        must_differ = name == lagging.NEGATIVE and lags  # the control must fail where it lags
        ok = diff > tol if must_differ else diff <= tol
        expect = "must differ" if must_differ else f"tol {tol:.0e}"
        rows.append(Row("ordering", name, ok, f"max diff {diff:.1e} ({expect})", f"vs {what}"))
    rows.append(
        Row(
            "ordering",
            "collectives through the lagging backend",
            gpu["collectives"] > 0 and gpu["poison left"] == 0,
            f"{gpu['collectives']} collectives, {lagging.VIRTUAL_RANKS} virtual ranks",
        )
    )


# ---- host synchronisations -------------------------------------------------------------------------


def _syncs_rank(rank: int, world: int, names: list[str]) -> dict[str, Any]:
    import longboat as lb

    lb.init()
    device = torch.device("cuda", 0)
    out: dict[str, Any] = {}
    for name in names:
        fields, allowed = SYNCS[name]
        try:
            model, opt = _build(name, 0, device)
            dmodel, dopt = lb.distribute(model, opt, lb.Strategy(**fields))
            k = _micro_steps(fields)
            x, y = _data(4 * k)
            batches = [(x[i].to(device), y[i].to(device)) for i in range(x.shape[0])]

            def step(xs: torch.Tensor, ys: torch.Tensor, dmodel=dmodel, dopt=dopt) -> None:
                dopt.zero_grad()
                F.cross_entropy(dmodel(xs), ys).backward()  # ``spare`` never takes part
                dopt.step()

            for xs, ys in batches[: 2 * k]:  # warm-up: optimizer state, kernels, caches
                step(xs, ys)
            torch.cuda.synchronize()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("error" if allowed == 0 else "warn")
                try:
                    for xs, ys in batches[2 * k :]:
                        step(xs, ys)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()
            messages = [str(w.message) for w in caught]
            syncs = [m[:120] for m in messages if SYNC_WARNING in m]
            others = sorted({m[:160] for m in messages if SYNC_WARNING not in m})
            out[name] = {"steps": 2, "syncs": syncs, "allowed": allowed, "warnings": others}
        except Exception:  # noqa: BLE001 - reported in the table
            out[name] = {"error": traceback.format_exc(limit=-4)}
    return out


def check_syncs(rows: list[Row]) -> None:
    names = list(SYNCS)
    (result,) = run_ranks(_syncs_rank, 1, names, timeout=180, env={"LONGBOAT_BACKEND": "nccl"})
    for name in names:
        r = result[name]
        if "error" in r:
            rows.append(Row("syncs", name, False, "host synchronised", r["error"].strip()[-300:]))
            continue
        n, allowed = len(r["syncs"]), r["allowed"]
        ok = n <= allowed * r["steps"]
        mode = "error" if allowed == 0 else f"warn, <= {allowed}/step"
        seen = "; ".join(r["warnings"])
        detail = f"sync debug mode {mode}" + (f"; other warnings: {seen}" if seen else "")
        rows.append(Row("syncs", name, ok, f"{n} in {r['steps']} steps", detail))


# ---- overhead on one GPU ---------------------------------------------------------------------------


def check_overhead(rows: list[Row], out: Path | None, quick: bool) -> None:
    from longboat.tools.bench import train

    for model, label, fields in OVERHEAD:
        config = train.Config(
            model,
            warmup=3 if quick else 5,
            steps=5 if quick else 10,
            rounds=5 if quick else 11,
            data="memory",
            workers=0,
            strategy=fields,
            device="cuda",
        )
        try:
            result = train.run_model(config, [1])
        except Exception:  # noqa: BLE001
            rows.append(
                Row("overhead", f"{model} {label}", False, "error", traceback.format_exc()[-300:])
            )
            continue
        lb_row = next(r for r in result if r["system"] == "longboat")
        ddp_row = next(r for r in result if r["system"] == "ddp")
        ratios = {  # each paired round by round: median [p25-p75]
            "plain": (lb_row["longboat_over_no_sync"], lb_row["longboat_over_no_sync_p25_p75"]),
            "DDP": (lb_row["longboat_over_ddp"], lb_row["longboat_over_ddp_p25_p75"]),
            "DDP lean": (lb_row["longboat_over_ddp_lean"], lb_row["longboat_over_ddp_lean_p25_p75"]),
        }
        shown = ", ".join(f"{m:.3f}x {k} [{q[0]:.3f}-{q[1]:.3f}]" for k, (m, q) in ratios.items())
        rows.append(
            Row(
                "overhead",
                f"{model} {label}, batch {lb_row['batch_per_rank']}",
                True,
                shown,
                f"longboat {lb_row['step_ms']:.1f} ms, DDP {ddp_row['step_ms']:.1f} ms; "
                f"{lb_row['rounds']} paired rounds; NCCL allreduce launched at world 1",
                goal=ratios["plain"][0] <= 1.02 and ratios["DDP lean"][0] <= 1.0,
            )
        )
        if out is not None:
            with open(out / "overhead.jsonl", "a") as f:
                f.write(json.dumps({"model": model, "precision": label, "rows": result}) + "\n")


# ---- torch.compile cut at the buckets ------------------------------------------------------------


def _compile_rank(rank: int, world: int) -> dict[str, Any]:
    """World-size-1 NCCL on CUDA: an 8-layer MLP trained eagerly and through ``model.compile()``
    (inductor, cut at 1 MB buckets) from the same start; then 2 compiled steps under
    ``torch.cuda.set_sync_debug_mode("error")``."""
    import longboat as lb

    lb.init()
    device = torch.device("cuda", 0)
    out: dict[str, Any] = {}
    g = torch.Generator().manual_seed(0)
    xs = torch.randn(6, 64, 512, generator=g).to(device)
    ys = torch.randint(0, 10, (6, 64), generator=g).to(device)
    for how in ("eager", "compiled"):
        torch.manual_seed(0)
        layers = [m for _ in range(7) for m in (torch.nn.Linear(512, 512), torch.nn.GELU())]
        module = torch.nn.Sequential(*layers, torch.nn.Linear(512, 10)).to(device)
        opt = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)
        model, opt = lb.distribute(module, opt, lb.Strategy(fuse_grad_size_in_MB=1))
        if how == "compiled":
            model.compile()
        for i in range(4):
            opt.zero_grad()
            F.cross_entropy(model(xs[i]), ys[i]).backward()
            opt.step()
        out[how] = [p.detach().to("cpu", copy=True) for p in module.parameters()]
        if how == "compiled":
            out["pieces"] = [sorted(p) for p in model.splitter.splits[-1]]
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                for i in range(4, 6):
                    opt.zero_grad()
                    F.cross_entropy(model(xs[i]), ys[i]).backward()
                    opt.step()
                out["syncs"] = "none"
            except RuntimeError as exc:
                out["syncs"] = str(exc)[:200]
            finally:
                torch.cuda.set_sync_debug_mode("default")
    return out


def check_compile(rows: list[Row]) -> None:
    (r,) = run_ranks(_compile_rank, 1, timeout=300, env={"LONGBOAT_BACKEND": "nccl"})
    diff = max((a - b).abs().max().item() for a, b in zip(r["eager"], r["compiled"], strict=True))
    rows.append(
        Row(
            "compile",
            "model.compile() vs eager, 4 SGD steps",
            diff <= 1e-4 and len(r["pieces"]) > 1,
            f"max diff {diff:.1e} (tol 1e-4)",
            f"{len(r['pieces'])} compiled pieces, buckets {r['pieces']}",
        )
    )
    rows.append(
        Row("compile", "host syncs, compiled steps", r["syncs"] == "none", r["syncs"], "")
    )


# ---- launcher and tests ------------------------------------------------------------------------------

_RANK_SCRIPT = """
import torch, torch.distributed as dist, longboat as lb
lb.init()
t = torch.ones(4, device="cuda")
dist.all_reduce(t)
assert dist.get_backend() == "nccl" and float(t[0]) == lb.world_size()
print("rank ran on", torch.cuda.get_device_name(), "backend", dist.get_backend())
"""


def _longboat(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    return subprocess.run(
        [sys.executable, "-m", "longboat", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )


def check_launcher(rows: list[Row]) -> None:
    gpus = torch.cuda.device_count()
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp, "rank.py")
        script.write_text(_RANK_SCRIPT)
        one = _longboat(
            "launch", "--nproc-per-node", str(gpus), "--log-dir", str(Path(tmp, "log")),
            str(script), timeout=120,
        )  # fmt: skip
        rows.append(
            Row(
                "launcher",
                f"launch --nproc-per-node {gpus} (NCCL)",
                one.returncode == 0,
                f"exit {one.returncode}",
                (one.stdout + one.stderr).strip().splitlines()[-1][:200] if one.returncode else "",
            )
        )
        over = _longboat("launch", "--nproc-per-node", str(gpus + 1), str(script), timeout=120)
        text = over.stdout + over.stderr
        refused = over.returncode != 0 and "LONGBOAT_BACKEND=gloo" in text
        rows.append(
            Row(
                "launcher",
                f"launch --nproc-per-node {gpus + 1} refused before any rank",
                refused and "Duplicate GPU" not in text,
                f"exit {over.returncode}",
                text.strip().splitlines()[-1][:200] if text.strip() else "",
            )
        )


def check_tests(rows: list[Row]) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])},
    )
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-200:]
    rows.append(Row("tests", "pytest -m gpu", done.returncode == 0, summary))


# ---- main ------------------------------------------------------------------------------------------


def table(rows: list[Row]) -> str:
    lines = ["| part | check | ok | result | detail |", "|---|---|---|---|---|"]
    for r in rows:
        detail = r.detail.replace("|", "/").replace("\n", " ")
        lines.append(f"| {r.part} | {r.check} | {r.status} | {r.result} | {detail} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {PARTS}")
    parser.add_argument("--out", default=None, help="directory for results.json and table.md")
    parser.add_argument("--quick", action="store_true", help="fewer timed rounds for overhead")
    args = parser.parse_args()
    parts = args.parts.split(",")
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown part(s) {unknown}; choose from {', '.join(PARTS)}")
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU visible (torch.cuda.is_available() is False)")
        return 2
    out = Path(args.out) if args.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    header = (
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, CUDA {torch.version.cuda}"
    )
    print(f"gpu_check on {header}", flush=True)
    rows: list[Row] = []
    checks: dict[str, Callable[[], None]] = {
        "ordering": lambda: check_ordering(rows),
        "equivalence": lambda: check_equivalence(rows),
        "syncs": lambda: check_syncs(rows),
        "compile": lambda: check_compile(rows),
        "overhead": lambda: check_overhead(rows, out, args.quick),
        "launcher": lambda: check_launcher(rows),
        "tests": lambda: check_tests(rows),
    }
    for part in parts:
        start = time.monotonic()
        try:
            checks[part]()
        except Exception:  # noqa: BLE001 - one broken part must not hide the others
            rows.append(Row(part, "(part)", False, "error", traceback.format_exc()[-400:]))
        print(f"gpu_check: {part} done in {time.monotonic() - start:.0f} s", flush=True)
    text = f"gpu_check on {header}\n\n{table(rows)}"
    print(text)
    if out is not None:
        (out / "table.md").write_text(text + "\n")
        (out / "results.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
    failed = [r for r in rows if not r.ok]
    print(f"\n{len(rows) - len(failed)} of {len(rows)} checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

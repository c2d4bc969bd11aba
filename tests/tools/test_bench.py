"""`longboat bench comm` and `longboat bench train` end to end at tiny sizes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from longboat.tools.bench import comm, train


def _longboat(*args: str) -> subprocess.CompletedProcess[str]:
    """``longboat bench`` writing to a pipe, as in a CI log, with an environment built from
    os.environ: a library in the test process may have exported COLUMNS=80 through C's
    setenv, which children inherit although os.environ does not show it."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    return subprocess.run(
        [sys.executable, "-m", "longboat", "bench", *args],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )


def test_bench_comm_end_to_end(tmp_path: Path) -> None:
    out = _longboat(
        "comm", "--nproc", "2", "--sizes", "1K,8K", "--repeats", "2",
        "--algorithms", "native,ring", "--json", str(tmp_path / "c.json"),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    report = json.loads((tmp_path / "c.json").read_text())
    assert report["world_size"] == 2 and report["sizes"] == [1024, 8192]
    assert set(report["results"]) == {"gloo", "native", "ring"}
    for per_size in report["results"].values():
        for size, r in per_size.items():
            assert r["algbw_GBps"] == pytest.approx(int(size) / r["seconds"] / 1e9)
            assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * 2 * (2 - 1) / 2)
    assert report["loopback_tcp_GBps"] > 0 and report["memcpy_GBps"] > 0
    assert "busbw" in out.stdout and "loopback TCP stream limit" in out.stdout


def test_size_parsing_and_algorithm_choice() -> None:
    assert comm.parse_sizes("1K, 4M,256MB") == [1024, 4 << 20, 256 << 20]
    with pytest.raises(ValueError, match="not a size"):
        comm.parse_sizes("lots")
    assert comm.busbw_factor(4) == 1.5
    assert "shm" not in comm.usable_algorithms(None, nodes=2)
    assert "hierarchical" not in comm.usable_algorithms(None, nodes=1)


@pytest.mark.slow  # a whole end-to-end run: the slow tier (CI runs it after the quick one)
def test_bench_train_end_to_end(tmp_path: Path) -> None:
    (tmp_path / "s.yaml").write_text("nccl_comm_num: 2\n")
    out = _longboat(
        "train", "--model", "mlp-tiny", "--nproc", "1,2", "--warmup", "1", "--steps", "2",
        "--rounds", "2", "--data", "loader", "--strategy", str(tmp_path / "s.yaml"),
        "--json", str(tmp_path / "t.json"), "--png", str(tmp_path / "t.png"),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    doc = json.loads((tmp_path / "t.json").read_text())
    assert doc["strategy"] == {"nccl_comm_num": 2}
    rows = doc["results"]["mlp-tiny"]
    assert [(r["system"], r["nproc"]) for r in rows] == [
        ("longboat", 1), ("ddp", 1), ("longboat", 2), ("ddp", 2),
    ]  # fmt: skip
    for r in rows:
        expected = r["batch_per_rank"] * r["nproc"] / r["step_ms"] * 1e3
        assert r["samples_per_s"] == pytest.approx(expected)
        assert r["efficiency"] == pytest.approx(r["speedup"] / r["nproc"])
        assert r["data_fraction"] >= 0 and r["input_bound"] == (r["data_fraction"] > 0.1)
        assert r["rounds"] == 2
    assert rows[0]["speedup"] == pytest.approx(1.0)
    assert (tmp_path / "t.png").stat().st_size > 0
    assert "samples/s" in out.stdout


@pytest.mark.slow  # compiles four systems on two ranks: the slow tier
def test_bench_train_compiled_end_to_end(tmp_path: Path) -> None:
    out = _longboat(
        "train", "--compile", "--model", "mlp-tiny", "--nproc", "2", "--warmup", "1",
        "--steps", "2", "--rounds", "2", "--json", str(tmp_path / "t.json"), "--markdown",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    rows = json.loads((tmp_path / "t.json").read_text())["results"]["mlp-tiny"]
    assert [(r["system"], r["compiled"]) for r in rows] == [("longboat", True), ("ddp", True)]
    assert all(r["longboat_over_ddp"] > 0 and r["longboat_over_no_sync"] > 0 for r in rows)
    assert "| mlp-tiny (compiled) | longboat | 2 |" in out.stdout
    assert "overlap" not in out.stderr  # lb.compile's model does not warn about lost overlap


@pytest.mark.slow  # six systems on two ranks: the slow tier
def test_bench_train_sharded_against_unsharded_ddp_and_zero(tmp_path: Path) -> None:
    out = _longboat(
        "train", "--model", "mlp-tiny", "--nproc", "2", "--warmup", "1", "--steps", "2",
        "--rounds", "3", "--set", "sharding=true", "--set", 'sharding_configs={"stage":2}',
        "--json", str(tmp_path / "t.json"), "--markdown",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    results = json.loads((tmp_path / "t.json").read_text())["results"]["mlp-tiny"]
    rows = {r["system"]: r for r in results}
    assert list(rows) == ["longboat", "longboat unsharded", "ddp", "ddp zero"]
    params_mb = rows["longboat"]["params"] * 4 / 2**20
    # SGD with momentum: one buffer per element, halved by either ZeRO; stage 2 halves gradients
    assert rows["longboat unsharded"]["optimizer_state_mb"] == pytest.approx(params_mb)
    assert rows["longboat"]["optimizer_state_mb"] == pytest.approx(params_mb / 2, rel=0.01)
    assert rows["ddp zero"]["optimizer_state_mb"] < 0.7 * params_mb
    assert rows["longboat"]["gradient_mb"] == pytest.approx(params_mb / 2, rel=0.01)
    assert rows["ddp"]["gradient_mb"] == pytest.approx(2 * params_mb)  # .grad and its buckets
    assert rows["longboat"]["longboat_over_this"] == 1.0
    assert all(r["longboat_over_this"] > 0 and r["device_peak_mb"] is None for r in rows.values())
    assert "| mlp-tiny | longboat, sharding stage 2 | 2 |" in out.stdout
    assert "sharded longboat / system" in out.stdout


@pytest.mark.slow  # five systems on two ranks: the slow tier
def test_bench_train_stage3_against_fsdp2_by_hand(tmp_path: Path) -> None:
    out = _longboat(
        "train", "--model", "mlp-tiny", "--nproc", "2", "--warmup", "1", "--steps", "2",
        "--rounds", "3", "--set", "sharding=true", "--set", "sharding_configs={stage: 3}",
        "--json", str(tmp_path / "t.json"), "--markdown",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    rows = {
        r["system"]: r for r in json.loads((tmp_path / "t.json").read_text())["results"]["mlp-tiny"]
    }
    assert list(rows) == ["longboat", "longboat unsharded", "ddp", "fsdp2 by hand"]
    whole = rows["longboat"]["params"] * 4 / 2**20
    for name in ("longboat", "fsdp2 by hand"):  # SGD with momentum: every part split in two
        for column in ("optimizer_state_mb", "gradient_mb", "parameter_mb"):
            assert rows[name][column] == pytest.approx(whole / 2, rel=0.05), (name, column)
    assert rows["longboat unsharded"]["parameter_mb"] == pytest.approx(whole)
    assert rows["fsdp2 by hand"]["longboat_over_this"] > 0
    assert "| mlp-tiny | longboat, sharding stage 3 | 2 |" in out.stdout
    assert "| mlp-tiny | fsdp2 by hand | 2 |" in out.stdout


def test_stage3_rows_set_longboat_against_fsdp2_by_hand() -> None:
    def system(steps: list[float], held: float) -> dict:
        memory = {"optimizer_state_mb": held, "gradient_mb": held, "parameter_mb": held}
        return {"step_s": steps, "data_s": [0.0] * len(steps), "memory": memory}

    raw = {
        2: {"params": 1, "batch_per_rank": 10, "world_size": 2, "sharding": {"stage": 3},
            "longboat": system([0.2, 0.4, 0.3], 0.5),
            "longboat unsharded": system([0.1, 0.2, 0.1], 1.0),
            "ddp": system([0.1, 0.2, 0.3], 1.0), "ddp lean": system([0.1, 0.1, 0.1], 1.0),
            "fsdp2 by hand": system([0.2, 0.5, 0.3], 0.5), "no sync": system([0.1, 0.1, 0.1], 1.0)},
    }  # fmt: skip
    rows = {r["system"]: r for r in train.summarise(raw)}
    assert list(rows) == ["longboat", "longboat unsharded", "ddp", "fsdp2 by hand"]
    assert rows["fsdp2 by hand"]["longboat_over_this"] == pytest.approx(1.0)  # 1, 0.8, 1
    table = train.markdown("m", list(rows.values()))
    assert "| m | longboat, sharding stage 3 | 2 | 300.00 |" in table
    assert "| parameters MB |" in table
    assert "| m | fsdp2 by hand | 2 | 300.00 |" in table and "| 0.50 | 0.50 | 0.50 |" in table


def test_summary_speedup_and_input_bound_flag() -> None:
    raw = {
        1: {"params": 1, "batch_per_rank": 10, "world_size": 1,
            "longboat": {"step_s": [0.1, 0.1], "data_s": [0.05, 0.05]},
            "ddp": {"step_s": [0.1, 0.1], "data_s": [0.0, 0.0]}},
        2: {"params": 1, "batch_per_rank": 10, "world_size": 2,
            "longboat": {"step_s": [0.125, 0.125], "data_s": [0.0, 0.0]},
            "ddp": {"step_s": [0.25, 0.25], "data_s": [0.0, 0.0]}},
    }  # fmt: skip
    rows = {(r["system"], r["nproc"]): r for r in train.summarise(raw)}
    assert rows[("longboat", 2)]["speedup"] == pytest.approx(1.6)  # 160 vs 100 samples/s
    assert rows[("longboat", 2)]["efficiency"] == pytest.approx(0.8)
    assert rows[("ddp", 2)]["efficiency"] == pytest.approx(0.4)
    assert rows[("longboat", 1)]["input_bound"] and not rows[("ddp", 1)]["input_bound"]
    assert rows[("longboat", 2)]["longboat_over_ddp"] == pytest.approx(0.5)


def test_sharded_rows_pair_every_system_with_longboat() -> None:
    def system(steps: list[float], state: float) -> dict:
        memory = {"optimizer_state_mb": state, "gradient_mb": 1.0}
        return {"step_s": steps, "data_s": [0.0] * len(steps), "memory": memory}

    raw = {
        2: {"params": 1, "batch_per_rank": 10, "world_size": 2, "sharding": {"stage": 1},
            "longboat": system([0.2, 0.4, 0.3], 0.5),
            "longboat unsharded": system([0.1, 0.4, 0.2], 1.0),
            "ddp": system([0.1, 0.2, 0.3], 1.0), "ddp lean": system([0.1, 0.1, 0.1], 1.0),
            "ddp zero": system([0.4, 0.8, 0.6], 0.5), "no sync": system([0.1, 0.1, 0.1], 1.0)},
    }  # fmt: skip
    rows = {r["system"]: r for r in train.summarise(raw)}
    assert list(rows) == ["longboat", "longboat unsharded", "ddp", "ddp zero"]
    assert rows["ddp zero"]["longboat_over_this"] == pytest.approx(0.5)  # paired, every round
    assert rows["longboat unsharded"]["longboat_over_this"] == pytest.approx(1.5)  # 2, 1, 1.5
    assert rows["ddp"]["longboat_over_this"] == pytest.approx(2.0)  # 2, 2, 1
    assert rows["longboat"]["step_ms_p25_p75"][0] <= 300 <= rows["longboat"]["step_ms_p25_p75"][1]
    assert rows["ddp zero"]["optimizer_state_mb"] == 0.5
    table = train.markdown("m", list(rows.values()))
    assert "| m | longboat, sharding stage 1 | 2 | 300.00 |" in table
    assert "| m | ddp zero | 2 | 600.00 |" in table and "| 0.50 | 1.00 |" in table


@pytest.mark.parametrize(
    "name", ["resnet", "transformer", "resnet-tiny", "transformer-tiny", "gpt2-tiny"]
)
def test_models_build_and_train_one_step(name: str) -> None:
    spec = train.MODELS[name]
    model = spec.build()
    g = torch.Generator().manual_seed(0)
    x, y = zip(*(spec.sample(g) for _ in range(2)), strict=True)
    system = train.System(model, torch.optim.SGD(model.parameters(), lr=0.1))
    train.train_step(system, torch.stack(x), torch.stack(y))
    assert all(p.grad is not None for p in model.parameters())


def test_gpu_sized_models_have_their_published_sizes() -> None:
    with torch.device("meta"):  # no memory, no time: shapes only
        resnet50 = train.MODELS["resnet50"].build()
        gpt2 = train.MODELS["gpt2-small"].build()
    assert sum(p.numel() for p in resnet50.parameters()) == 25_557_032  # torchvision's
    n = sum(p.numel() for p in gpt2.parameters())
    assert 123e6 < n < 165e6  # GPT-2 small: 124 M with a tied head, 163 M untied


def test_cuda_without_gpus_is_refused_before_any_rank() -> None:
    out = _longboat("train", "--model", "mlp-tiny", "--device", "cuda", "--nproc", "1")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert out.returncode == 2 and "0 GPU(s) seen" in out.stdout


def test_bad_model_is_named() -> None:
    out = _longboat("train", "--model", "vgg")
    assert out.returncode == 2 and "unknown model(s) ['vgg']" in out.stdout

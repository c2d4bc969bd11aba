"""Atomic save / weights_only load of training checkpoints, crashes mid-save, resume on restart."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from longboat.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

TORCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _tmp_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if ".tmp-" in p.name)


def _train(model: torch.nn.Module, opt: Any, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 4, generator=gen)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()


def _fresh(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    sgd = torch.optim.SGD(model[0].parameters(), lr=0.1, momentum=0.9)
    adam = torch.optim.Adam(model[2].parameters(), lr=0.01)
    return model, sgd, adam


class _Both:
    """Step two optimizers as one (for _train)."""

    def __init__(self, a: torch.optim.Optimizer, b: torch.optim.Optimizer):
        self.a, self.b = a, b

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.a.zero_grad(set_to_none)
        self.b.zero_grad(set_to_none)

    def step(self, closure: Any = None) -> None:
        self.a.step()
        self.b.step()


def _state(model: torch.nn.Module, sgd: Any, adam: Any, step: int) -> dict[str, Any]:
    return {
        "model": model.state_dict(),
        "sgd": sgd.state_dict(),
        "adam": adam.state_dict(),
        "step": step,
    }


@pytest.fixture
def single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in TORCH_ENV:
        monkeypatch.delenv(name, raising=False)


def test_model_sgd_momentum_adam_round_trip_and_resume_identically(
    tmp_path: Path, single_process: None
) -> None:
    model, sgd, adam = _fresh()
    _train(model, _Both(sgd, adam), steps=3, seed=1)
    path = tmp_path / "run" / "last.pt"  # parent directory is created
    assert save_checkpoint(path, _state(model, sgd, adam, 3)) is True

    state = load_checkpoint(path)
    assert state is not None and state["step"] == 3
    assert set(state["sgd"]["state"][0]) == {"momentum_buffer"}
    assert set(state["adam"]["state"][0]) >= {"exp_avg", "exp_avg_sq", "step"}
    model2, sgd2, adam2 = _fresh(seed=123)  # different init: everything must come from the file
    model2.load_state_dict(state["model"])
    sgd2.load_state_dict(state["sgd"])
    adam2.load_state_dict(state["adam"])

    _train(model, _Both(sgd, adam), steps=3, seed=2)
    _train(model2, _Both(sgd2, adam2), steps=3, seed=2)
    for (name, a), b in zip(model.state_dict().items(), model2.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    assert _tmp_files(path.parent) == []


def test_load_of_missing_file_returns_none(tmp_path: Path) -> None:
    assert load_checkpoint(tmp_path / "nope.pt") is None
    assert load_checkpoint(tmp_path / "no" / "dir" / "nope.pt") is None


def _write_half_then(fail: BaseException):
    real_save = torch.save

    def half_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        import io

        buf = io.BytesIO()
        real_save(obj, buf, *args, **kwargs)
        f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
        raise fail

    return half_save


@pytest.mark.parametrize("where", ["torch.save", "os.fsync", "os.replace"])
def test_crash_during_save_keeps_previous_checkpoint(
    tmp_path: Path, single_process: None, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    path = tmp_path / "last.pt"
    save_checkpoint(path, {"w": torch.arange(5.0), "step": 1})
    before = path.read_bytes()

    if where == "torch.save":
        monkeypatch.setattr(torch, "save", _write_half_then(KeyboardInterrupt()))
    else:
        name = where.split(".")[1]

        def boom(*args: Any) -> None:
            raise OSError(28, "No space left on device (simulated)")

        monkeypatch.setattr(os, name, boom)
    with pytest.raises((KeyboardInterrupt, OSError)):
        save_checkpoint(path, {"w": torch.zeros(100_000), "step": 2})
    monkeypatch.undo()

    assert path.read_bytes() == before
    state = load_checkpoint(path)
    assert state is not None and state["step"] == 1
    torch.testing.assert_close(state["w"], torch.arange(5.0))
    assert _tmp_files(tmp_path) == []  # the temporary file was removed on error


_KILLED_SAVER = textwrap.dedent(
    """
    import io, sys, time, torch
    from longboat.checkpoint import save_checkpoint
    real_save = torch.save
    def half_save(obj, f):
        buf = io.BytesIO()
        real_save(obj, buf)
        f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
        f.flush()
        print("HALF", flush=True)
        time.sleep(120)
    torch.save = half_save
    save_checkpoint(sys.argv[1], {"w": torch.ones(1_000_000), "step": 2})
    """
)


def test_sigkill_mid_write_keeps_previous_and_next_save_cleans_up(
    tmp_path: Path, single_process: None
) -> None:
    path = tmp_path / "last.pt"
    save_checkpoint(path, {"w": torch.arange(3.0), "step": 1})
    env = {k: v for k, v in os.environ.items() if k not in TORCH_ENV}
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_SAVER, str(path)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "HALF"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    stale = _tmp_files(tmp_path)
    assert len(stale) == 1 and stale[0].startswith(".last.pt.tmp-")
    assert (tmp_path / stale[0]).stat().st_size > 1_000_000  # it really was mid-write

    state = load_checkpoint(path)  # ignores the stale temporary file
    assert state is not None and state["step"] == 1
    torch.testing.assert_close(state["w"], torch.arange(3.0))

    assert save_checkpoint(path, {"step": 3})
    assert _tmp_files(tmp_path) == []
    assert load_checkpoint(path) == {"step": 3}


def test_only_rank_0_writes_unless_all_ranks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = dict(zip(TORCH_ENV, ("1", "2", "1", "2", "127.0.0.1", "29500"), strict=True))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    path = tmp_path / "last.pt"
    assert save_checkpoint(path, {"step": 1}) is False
    assert not path.exists() and list(tmp_path.iterdir()) == []

    assert save_checkpoint(path, {"step": 1}, all_ranks=True) is True
    assert load_checkpoint(path) == {"step": 1}

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert save_checkpoint(path, {"step": 2}) is True
    assert load_checkpoint(path) == {"step": 2}


def _damaged(data: bytes) -> bytes:
    """The archive with bytes of its pickle overwritten: the zip index still reads."""
    at = data.index(b"data.pkl") + 8 + 64
    return data[:at] + b"\xff" * 16 + data[at + 16 :]


@pytest.mark.parametrize("kind", ["garbage", "truncated", "empty", "damaged"])
def test_corrupt_file_raises_naming_the_path(
    tmp_path: Path, single_process: None, kind: str
) -> None:
    path = tmp_path / "last.pt"
    save_checkpoint(path, {"w": torch.ones(1000), "step": 1})
    data = path.read_bytes()
    path.write_bytes(
        {
            "garbage": b"not a checkpoint\n" * 20,
            "truncated": data[: len(data) // 2],
            "empty": b"",
            "damaged": _damaged(data),
        }[kind]
    )
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    message = str(info.value)
    assert str(path) in message and "written by something else" in message
    assert "restore" in message and "\n" not in message  # what to do, on one line
    assert info.value.__cause__ is not None  # torch's own error, chained


def test_a_directory_or_an_unreadable_file_is_a_checkpoint_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "last.pt"
    folder.mkdir()
    with pytest.raises(CheckpointError, match="is a directory, not a checkpoint file") as info:
        load_checkpoint(folder)
    assert isinstance(info.value.__cause__, IsADirectoryError)

    def refused(*args: object, **kwargs: object) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(torch, "load", refused)
    with pytest.raises(CheckpointError, match="cannot be read .Permission denied.; check its"):
        load_checkpoint(tmp_path / "other.pt")


def test_file_that_is_not_a_dict_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "list.pt"
    torch.save([torch.ones(2)], path)
    with pytest.raises(CheckpointError, match="holds a list"):
        load_checkpoint(path)


class _Payload:
    """Unpickling this with weights_only=False creates the file named by ``marker``."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.marker, "w"))


def test_custom_objects_are_never_unpickled(tmp_path: Path) -> None:
    path, marker = tmp_path / "evil.pt", tmp_path / "pwned"
    torch.save({"model": {"w": torch.ones(2)}, "x": _Payload(str(marker))}, path)

    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    assert str(path) in str(info.value) and "weights_only" in str(info.value)
    assert not marker.exists()

    # the payload is live: an unrestricted load would have run it
    torch.load(path, weights_only=False)
    assert marker.exists()


class _Config:
    lr = 0.1


def test_state_that_would_not_load_is_refused_at_save(tmp_path: Path, single_process: None) -> None:
    path = tmp_path / "last.pt"
    save_checkpoint(path, {"step": 1})
    with pytest.raises(CheckpointError, match=r"_Config.*add_safe_globals"):
        save_checkpoint(path, {"step": 2, "config": _Config()})
    assert load_checkpoint(path) == {"step": 1}
    assert _tmp_files(tmp_path) == []


@pytest.mark.parametrize(
    ("state", "match"),
    [
        ([("step", 1)], "must be a mapping with str keys.*got list"),
        ({"step": 1, 3: "x"}, r"keys must be str; got 3 \(int\)"),
    ],
)
def test_state_is_validated(tmp_path: Path, state: Any, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        save_checkpoint(tmp_path / "x.pt", state)
    assert list(tmp_path.iterdir()) == []


_RESUMING_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch
    from longboat.checkpoint import load_checkpoint, save_checkpoint

    path, log, steps = sys.argv[1], sys.argv[2], 6
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    state = load_checkpoint(path)
    start = 0
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = state["step"] + 1
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if os.environ["RANK"] == "0":
        with open(log, "a") as f:
            f.write(json.dumps({"attempt": attempt, "start": start}) + "\\n")
    for step in range(start, steps):
        gen = torch.Generator().manual_seed(step)
        opt.zero_grad()
        model(torch.randn(8, 4, generator=gen)).pow(2).mean().backward()
        opt.step()
        if step % 2 == 0:
            save_checkpoint(path, {"model": model.state_dict(), "optimizer": opt.state_dict(),
                                   "step": step})
        if step == 3 and attempt == 0 and os.environ["RANK"] == "0":
            raise SystemExit("simulated crash at step 3")
    if os.environ["RANK"] == "0":
        save_checkpoint(path, {"model": model.state_dict(), "optimizer": opt.state_dict(),
                               "step": steps - 1})
    """
)


@pytest.mark.slow  # slow tier: restarts and kills ranks
def test_group_restart_resumes_from_last_checkpoint(tmp_path: Path) -> None:
    import json

    from longboat.launch.local import launch_local

    script, path, log = tmp_path / "train.py", tmp_path / "ckpt" / "last.pt", tmp_path / "log"
    script.write_text(_RESUMING_SCRIPT)
    launch_local(
        sys.executable,
        [str(script), str(path), str(log)],
        nproc=2,
        max_restarts=1,
        env={"OMP_NUM_THREADS": "1"},
        timeout=120,
    )
    attempts = [json.loads(line) for line in log.read_text().splitlines()]
    assert attempts == [{"attempt": 0, "start": 0}, {"attempt": 1, "start": 3}]

    torch.manual_seed(0)  # the same six steps without a crash
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(6):
        gen = torch.Generator().manual_seed(step)
        opt.zero_grad()
        model(torch.randn(8, 4, generator=gen)).pow(2).mean().backward()
        opt.step()
    state = load_checkpoint(path)
    assert state is not None and state["step"] == 5
    for name, value in model.state_dict().items():
        torch.testing.assert_close(state["model"][name], value, rtol=0, atol=0, msg=name)

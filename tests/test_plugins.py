"""A toy allreduce algorithm and a toy compressor, registered outside src/ (tests/_toy_plugins.py),
are accepted by the Strategy, used by lb.distribute on 2 Gloo ranks and listed with the plug-ins
(the committed reference stays as it is); built-ins are exactly the modules of a package."""

from __future__ import annotations

import importlib
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from longboat.registry import ALGORITHMS, COMPRESSORS, Registry, package_modules
from longboat.strategy import (
    FIELDS,
    Strategy,
    StrategyError,
    plugins_markdown,
    reference_markdown,
)
from tests._dist import run_ranks

WORLD = 2
STEPS = 3
TOYS = "tests._toy_plugins"


@pytest.fixture
def toys() -> Iterator[ModuleType]:
    """The toy plugins, registered for one test and removed after it."""
    with ALGORITHMS.scoped(), COMPRESSORS.scoped():
        sys.modules.pop(TOYS, None)
        try:
            yield importlib.import_module(TOYS)
        finally:
            sys.modules.pop(TOYS, None)


def test_strategy_accepts_registered_names(toys: ModuleType) -> None:
    s = Strategy(env={}, allreduce_algorithm=toys.ALGORITHM)
    assert s.allreduce_algorithm == toys.ALGORITHM
    s = Strategy(env={}, gradient_compression=toys.COMPRESSOR, toy_identity_configs={"tag": 7})
    assert s.gradient_compression == toys.COMPRESSOR
    assert dict(s.toy_identity_configs) == {"tag": 7}
    assert Strategy(env={}).toy_identity_configs["tag"] == 0


def test_misspelt_names_and_keys_get_did_you_mean(toys: ModuleType) -> None:
    with pytest.raises(
        StrategyError, match=r"got 'toy_allreduse' \(str\); did you mean 'toy_allreduce'"
    ):
        Strategy(env={}, allreduce_algorithm="toy_allreduse")
    with pytest.raises(StrategyError, match=r"did you mean 'toy_identity'"):
        Strategy(env={}, gradient_compression="toy_identty")
    with pytest.raises(StrategyError, match=r"key 'tga'; did you mean 'tag'"):
        Strategy(env={}, toy_identity_configs={"tga": 1})
    with pytest.raises(StrategyError, match=r"toy_identity_configs\['tag'\] must be int >= 0"):
        Strategy(env={}, toy_identity_configs={"tag": -1})


def test_unregistered_after_the_fixture() -> None:
    assert "toy_allreduce" not in ALGORITHMS and "toy_identity" not in COMPRESSORS
    with pytest.raises(StrategyError, match="allreduce_algorithm must be one of"):
        Strategy(env={}, allreduce_algorithm="toy_allreduce")
    assert "toy_identity_configs" not in Strategy(env={}).to_dict()


def test_registered_plugins_leave_the_committed_reference_current(toys: ModuleType) -> None:
    """A new algorithm or compressor (its config field included) is one module: the generated
    reference of docs/strategy.md does not change with it."""
    assert f"{toys.COMPRESSOR}_configs" in FIELDS
    docs = Path(__file__).resolve().parents[1] / "docs" / "strategy.md"
    assert reference_markdown() in docs.read_text(encoding="utf-8")


def test_the_plugin_listing_shows_the_toys(toys: ModuleType) -> None:
    text = plugins_markdown()
    assert (
        "| `toy_allreduce` | never | yes | no | The backend's allreduce, counting each call. |"
        in text
    )
    assert "`gradient_compression='toy_identity'`" in text
    assert "| `toy_identity_configs` | `tag` | int >= 0 | `0` |" in text


def _model() -> nn.Module:
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.linspace(-0.5, 0.5, p.numel()).sin().reshape(p.shape) * (i + 1) / 2)
    return model


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    batches = []
    for step in range(STEPS):
        x = torch.arange(32, dtype=torch.float32).reshape(8, 4).add(step).mul(0.37).sin()
        batches.append((x, torch.arange(8).add(step) % 3))
    return batches


def _train(rank: int, world: int, folder: str) -> dict[str, Any]:
    import os

    import longboat as lb

    os.environ["TOY_PLUGIN_DIR"] = folder
    toys = importlib.import_module(TOYS)
    lb.init()
    model = _model()
    strategy = lb.Strategy(
        allreduce_algorithm=toys.ALGORITHM,
        gradient_compression=toys.COMPRESSOR,
        toy_identity_configs={"tag": 7},
    )
    dmodel, opt = lb.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy)
    for x, y in _batches():
        opt.zero_grad()
        part = slice(rank * len(x) // world, (rank + 1) * len(x) // world)
        F.cross_entropy(dmodel(x[part]), y[part]).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_distribute_uses_the_toys_and_trains_like_one_process(tmp_path: Path) -> None:
    ranks = run_ranks(_train, WORLD, str(tmp_path), timeout=120)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in _batches():
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    for got in ranks:
        for name, value in model.named_parameters():
            torch.testing.assert_close(got[name], value.detach(), rtol=1e-5, atol=1e-6)
    for rank in range(WORLD):
        compressed = Path(tmp_path, f"toy_identity.{rank}").read_text().split()
        assert len(compressed) >= STEPS and set(compressed) == {"7"}
        algorithm_calls = Path(tmp_path, f"toy_allreduce.{rank}").read_text().splitlines()
        assert len(algorithm_calls) >= len(compressed)


def _builtin_registries() -> list[Registry]:
    from longboat.comm.algorithms import hierarchical
    from longboat.ps.trainer import modes

    return [ALGORITHMS, COMPRESSORS, hierarchical._INTRA, modes._MODES]


@pytest.mark.parametrize("registry", _builtin_registries(), ids=lambda r: r.kind)
def test_builtins_are_exactly_the_modules_of_the_package_folder(registry: Registry) -> None:
    """A registry imports every module of its package's folder and no list of its own, and
    each built-in entry comes from one of them: a new built-in is one file in that folder."""
    assert registry.package is not None
    folder = Path(importlib.import_module(registry.package).__path__[0])
    found = sorted(
        f"{registry.package}.{p.stem if p.suffix == '.py' else p.name}"
        for p in folder.iterdir()
        if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").exists()
    )
    assert package_modules(registry.package) == found
    registry.names()  # loads the built-ins
    assert set(found) <= set(sys.modules)
    builtin = [e for e in registry.entries() if e.factory.__module__.startswith("longboat.")]
    assert builtin and {e.factory.__module__ for e in builtin} <= {registry.package, *found}


def test_a_lookup_during_the_builtin_import_waits_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Threads (PS trainers started in-process) may look a name up while another thread is
    still importing the built-in entries: they must wait, not see a half-filled registry."""
    import threading

    package = tmp_path / "slow_builtins"
    package.mkdir()
    (package / "__init__.py").write_text(
        textwrap.dedent(
            """
            import threading
            from longboat.registry import Registry
            STARTED = threading.Event()
            REGISTRY = Registry("thing", __name__)
            """
        )
    )
    (package / "builtin.py").write_text(
        textwrap.dedent(
            """
            import time
            from slow_builtins import REGISTRY, STARTED
            STARTED.set()
            time.sleep(0.2)
            REGISTRY.register("builtin")(lambda: None)
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("slow_builtins", "slow_builtins.builtin"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    slow = importlib.import_module("slow_builtins")

    seen: list[list[str]] = []
    first = threading.Thread(target=lambda: seen.append(slow.REGISTRY.names()))
    first.start()
    slow.STARTED.wait(5)
    seen.append(slow.REGISTRY.names())  # while the first thread is still loading
    first.join(5)
    assert seen == [["builtin"], ["builtin"]]

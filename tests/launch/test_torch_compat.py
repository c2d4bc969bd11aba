"""The launcher builds torch's launch settings from what the installed torch has.

torch 2.11 (what GPU images ship) has no ``LaunchConfig.shutdown_timeout`` and no
``shutdown_timeout`` parameter of ``LocalElasticAgent``; both came in 2.12. Stand-ins shaped like
2.11's classes are put into `longboat.launch.torch_compat`, so that path runs on any torch.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import signal
from typing import Any

import pytest
import torch.distributed as dist
from torch.distributed.launcher.api import LaunchConfig

from longboat.launch import local, runner, supervisor, torch_compat
from longboat.launch.spec import LaunchSpec

pytestmark = pytest.mark.timeout(120)

#: The fields of torch 2.11.0's LaunchConfig (torch/distributed/launcher/api.py at v2.11.0).
LAUNCH_CONFIG_2_11 = (
    "min_nodes",
    "max_nodes",
    "nproc_per_node",
    "logs_specs",
    "run_id",
    "role",
    "rdzv_endpoint",
    "rdzv_backend",
    "rdzv_configs",
    "rdzv_timeout",
    "max_restarts",
    "monitor_interval",
    "start_method",
    "log_line_prefix_template",
    "metrics_cfg",
    "local_addr",
    "event_log_handler",
    "numa_options",
    "signals_to_handle",
    "duplicate_stdout_filters",
    "duplicate_stderr_filters",
    "virtual_local_rank",
)


def launch_config_2_11() -> type:
    """A dataclass with this torch's LaunchConfig fields that torch 2.11 also had."""
    kept = [f for f in dataclasses.fields(LaunchConfig) if f.name in LAUNCH_CONFIG_2_11]
    spec = [(f.name, f.type, _default(f)) for f in kept]
    return dataclasses.make_dataclass("LaunchConfig", spec)


def _default(f: dataclasses.Field) -> dataclasses.Field:
    if f.default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=f.default_factory)
    if f.default is not dataclasses.MISSING:
        return dataclasses.field(default=f.default)
    return dataclasses.field()


class Agent211:
    """The keyword arguments of torch 2.11's LocalElasticAgent (no shutdown_timeout)."""

    def __init__(
        self,
        spec: Any,
        logs_specs: Any,
        start_method: str = "spawn",
        exit_barrier_timeout: float = 300,
        log_line_prefix_template: str | None = None,
    ):
        raise AssertionError("only its signature is read")


@pytest.fixture
def torch_2_11(monkeypatch):
    """torch_compat sees 2.11's LaunchConfig and agent."""
    stand_in = launch_config_2_11()
    monkeypatch.setattr(torch_compat, "LaunchConfig", stand_in)
    monkeypatch.setattr(torch_compat, "LocalElasticAgent", Agent211)
    return stand_in


def node_spec(tmp_path) -> LaunchSpec:
    return LaunchSpec(target="train.py", target_args=[], nproc_per_node=2, log_dir=str(tmp_path))


def test_the_stand_in_refuses_what_torch_2_11_refuses(torch_2_11):
    with pytest.raises(TypeError, match="shutdown_timeout"):
        torch_2_11(min_nodes=1, max_nodes=1, nproc_per_node=2, shutdown_timeout=3)


def test_launch_config_on_the_installed_torch(tmp_path):
    spec = node_spec(tmp_path)
    config = runner._config(spec, "127.0.0.1:29500", "run-1", runner._logs(spec))
    assert isinstance(config, LaunchConfig)
    assert (config.nproc_per_node, config.rdzv_backend, config.rdzv_endpoint) == (
        2,
        "static",
        "127.0.0.1:29500",
    )
    assert config.rdzv_configs == {"rank": 0, "timeout": spec.timeout}


def test_launch_config_without_the_newer_fields(torch_2_11, tmp_path):
    spec = node_spec(tmp_path)
    config = runner._config(spec, "127.0.0.1:29500", "run-1", runner._logs(spec))
    assert type(config) is torch_2_11
    assert (config.nproc_per_node, config.run_id, config.start_method) == (2, "run-1", "spawn")
    config = local._launch_config(2, 29500, str(tmp_path), "run-2", 0, keep_logs=False)
    assert type(config) is torch_2_11
    assert config.rdzv_endpoint == "127.0.0.1:29500"


def test_a_setting_this_torch_lacks_is_left_out_with_a_debug_log(torch_2_11, caplog):
    with caplog.at_level(logging.DEBUG, logger="longboat.launch"):
        config = torch_compat.launch_config(
            min_nodes=1, max_nodes=1, nproc_per_node=1, shutdown_timeout=3
        )
    assert not hasattr(config, "shutdown_timeout")
    assert "LaunchConfig has no shutdown_timeout" in caplog.text


def test_worker_spec_takes_the_config_settings_this_torch_has():
    @dataclasses.dataclass
    class OldConfig:  # a LaunchConfig without the settings newer releases copy into the spec
        event_log_handler: str = "null"

    spec = torch_compat.worker_spec(
        OldConfig(),
        role="trainer",
        local_world_size=1,
        entrypoint="python",
        rdzv_handler=None,
        max_restarts=0,
        monitor_interval=0.1,
        a_setting_of_a_later_torch=True,
    )
    assert (spec.role, spec.local_world_size, spec.event_log_handler) == ("trainer", 1, "null")


def test_the_grace_period_covers_every_stop_and_goes_to_torch_where_its_agent_takes_it():
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    takes_it = "shutdown_timeout" in inspect.signature(LocalElasticAgent.__init__).parameters
    expected = {"shutdown_grace_s": 3}  # the survivors of a failed rank get it too
    if takes_it:
        expected["shutdown_timeout"] = 3
    assert supervisor.shutdown_grace(3) == expected
    assert supervisor.shutdown_grace(None) == {}


def test_the_grace_period_is_applied_by_longboat_on_torch_2_11(torch_2_11):
    assert supervisor.shutdown_grace(3) == {"shutdown_grace_s": 3}


class FakeContext:
    """Records how torch would have closed its worker processes."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def close(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append((args, kwargs))


def test_a_close_without_a_timeout_gets_the_grace_period():
    pcontext, hooked = FakeContext(), []
    supervisor._before_close(pcontext, lambda: hooked.append(1), 3)  # type: ignore[arg-type]
    pcontext.close()
    pcontext.close(signal.SIGTERM)
    pcontext.close(signal.SIGTERM, 30)
    pcontext.close(timeout=7)
    assert [kw.get("timeout") for _, kw in pcontext.calls] == [3, 3, None, 7]
    assert pcontext.calls[2][0] == (signal.SIGTERM, 30)
    assert len(hooked) == 4


def test_a_close_is_left_alone_where_torch_applies_the_grace_period():
    pcontext = FakeContext()
    supervisor._before_close(pcontext, lambda: None)  # type: ignore[arg-type]
    pcontext.close(signal.SIGTERM)
    assert pcontext.calls == [((signal.SIGTERM,), {})]


def rank_and_world() -> tuple[int, int]:
    dist.init_process_group("gloo")
    try:
        return dist.get_rank(), dist.get_world_size()
    finally:
        dist.destroy_process_group()


def test_ranks_run_with_the_settings_of_torch_2_11(torch_2_11, monkeypatch):
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    taken: list[dict[str, Any]] = []
    real_init = LocalElasticAgent.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        taken.append(kwargs)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(LocalElasticAgent, "__init__", init)
    assert local.launch_local(rank_and_world, nproc=2) == {0: (0, 2), 1: (1, 2)}
    assert "shutdown_timeout" not in taken[0]

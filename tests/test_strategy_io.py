"""Strategy dicts, files, environment overrides, sources, printing and the generated docs."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import yaml

from longboat.strategy import (
    FIELDS,
    KNOWN_ENV_VARS,
    Strategy,
    StrategyError,
    plugins_markdown,
    reference_markdown,
)
from longboat.strategy.__main__ import main as strategy_main

DOCS = Path(__file__).resolve().parents[1] / "docs" / "strategy.md"
LOGGER = "longboat.strategy"


def make(**fields: Any) -> Strategy:
    return Strategy(env={}, **fields)


def busy() -> Strategy:
    """A Strategy with tricky values in every kind of field."""
    return make(
        nccl_comm_num=3,
        fuse_grad_size_in_MB=0.001,
        last_comm_group_size_MB=0.25,
        gradient_merge=True,
        gradient_merge_configs={"k_steps": 4, "avg": False},
        amp=True,
        amp_configs={"dtype": "bfloat16", "custom_white_list": ["matmul", "conv2d"]},
        dgc_configs={"sparsity": [0.75, 0.9375, 0.999]},
        lars_configs={"epsilon": 1e-8},
        build_strategy={"fuse_bn_act_ops": True},
        execution_strategy={"num_threads": 4},
        mode="ps",
        a_sync=False,
        a_sync_configs={"k_steps": 100},
    )


# ---- dicts and files --------------------------------------------------------------------


def test_to_dict_is_flat_plain_and_complete() -> None:
    d = busy().to_dict()
    assert set(d) == set(FIELDS)
    assert type(d["amp_configs"]) is dict and type(d["amp_configs"]["custom_white_list"]) is list
    assert d["num_threads"] == 4


def test_to_dict_nested_uses_fleet_groups() -> None:
    d = busy().to_dict(nested=True)
    assert d["build_strategy"]["fuse_bn_act_ops"] is True
    assert d["execution_strategy"]["num_threads"] == 4
    assert "num_threads" not in d and "fuse_bn_act_ops" not in d


@pytest.mark.parametrize("nested", [False, True])
def test_dict_round_trip(nested: bool) -> None:
    s = busy()
    assert Strategy.from_dict(s.to_dict(nested=nested), env={}) == s


def test_to_dict_is_detached() -> None:
    s = make()
    s.to_dict()["amp_configs"]["custom_white_list"].append("x")
    assert s.amp_configs["custom_white_list"] == []


def test_from_dict_rejects_field_given_flat_and_nested() -> None:
    with pytest.raises(StrategyError, match="'num_threads' is given twice"):
        Strategy.from_dict({"num_threads": 2, "execution_strategy": {"num_threads": 2}}, env={})


def test_from_dict_rejects_non_mapping() -> None:
    with pytest.raises(StrategyError, match="expected a mapping"):
        Strategy.from_dict([("nccl_comm_num", 2)], env={})  # type: ignore[arg-type]


@pytest.mark.parametrize("suffix", [".yaml", ".yml", ".json"])
def test_file_round_trip_is_exact(tmp_path: Path, suffix: str) -> None:
    s = busy()
    path = tmp_path / f"strategy{suffix}"
    s.save(path)
    loaded = Strategy.load(path, env={})
    assert loaded == s
    assert loaded.to_dict() == s.to_dict()
    assert loaded.source("nccl_comm_num") == "file"
    assert loaded.source("fuse_all_reduce_ops") == "file"


def test_saved_yaml_uses_nested_groups(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    make(num_threads=2).save(path)
    data = yaml.safe_load(path.read_text())
    assert data["execution_strategy"]["num_threads"] == 2
    assert data["fuse_grad_size_in_MB"] == 32.0


def test_load_partial_flat_and_nested_file(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"nccl_comm_num": 2, "BuildStrategy": {"fuse_bn_act_ops": True}}))
    s = Strategy.load(path, env={})
    assert (s.nccl_comm_num, s.fuse_bn_act_ops, s.num_threads) == (2, True, 1)


def test_load_empty_yaml_gives_defaults(tmp_path: Path) -> None:
    path = tmp_path / "empty.yml"
    path.write_text("")
    assert Strategy.load(path, env={}) == make()


def test_load_errors_name_the_file_and_key(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("nccl_comm_nums: 2\n")
    with pytest.raises(
        StrategyError,
        match=rf"{path}: unknown Strategy field 'nccl_comm_nums'; did you mean 'nccl_comm_num'",
    ):
        Strategy.load(path, env={})
    path.write_text("amp_configs:\n  incr_ratoi: 3\n")
    with pytest.raises(
        StrategyError,
        match=r"bad.yaml: unknown Strategy.amp_configs key 'incr_ratoi'; did you mean 'incr_ratio'",
    ):
        Strategy.load(path, env={})
    path.write_text("nccl_comm_num: 0\n")
    with pytest.raises(
        StrategyError, match=r"bad.yaml: Strategy.nccl_comm_num must be int in \[1, 64\], got 0"
    ):
        Strategy.load(path, env={})
    path.write_text("- 1\n- 2\n")
    with pytest.raises(StrategyError, match="expected a mapping"):
        Strategy.load(path, env={})
    path.write_text("a: [1,\n")
    with pytest.raises(StrategyError, match="not valid yaml"):
        Strategy.load(path, env={})


def test_unknown_file_extension(tmp_path: Path) -> None:
    with pytest.raises(StrategyError, match=r"unknown strategy file type '.toml'"):
        make().save(tmp_path / "s.toml")
    assert not (tmp_path / "s.toml").exists()
    with pytest.raises(StrategyError, match="use .yaml, .yml or .json"):
        Strategy.load(tmp_path / "s.txt", env={})


# ---- environment ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("var", "text", "field", "expected"),
    [
        ("LONGBOAT_NCCL_COMM_NUM", "2", "nccl_comm_num", 2),
        ("LONGBOAT_FUSE_GRAD_SIZE_IN_MB", "0.5", "fuse_grad_size_in_MB", 0.5),
        ("LONGBOAT_FUSE_GRAD_SIZE_IN_MB", "8", "fuse_grad_size_in_MB", 8.0),
        ("LONGBOAT_GRADIENT_MERGE", "true", "gradient_merge", True),
        ("LONGBOAT_GRADIENT_MERGE", "YES", "gradient_merge", True),
        ("LONGBOAT_GRADIENT_MERGE", "1", "gradient_merge", True),
        ("LONGBOAT_FUSE_ALL_REDUCE_OPS", "False", "fuse_all_reduce_ops", False),
        ("LONGBOAT_FUSE_ALL_REDUCE_OPS", "no", "fuse_all_reduce_ops", False),
        ("LONGBOAT_FUSE_ALL_REDUCE_OPS", "0", "fuse_all_reduce_ops", False),
        ("LONGBOAT_MODE", " ps ", "mode", "ps"),
        ("LONGBOAT_NUM_THREADS", "4", "num_threads", 4),
    ],
)
def test_env_scalar_parsing(var: str, text: str, field: str, expected: Any) -> None:
    s = Strategy(env={var: text})
    assert getattr(s, field) == expected and type(getattr(s, field)) is type(expected)
    assert s.source(field) == f"env:{var}"


@pytest.mark.parametrize("text", ['{"init_loss_scaling": 1024}', "{init_loss_scaling: 1024}"])
def test_env_config_json_or_yaml_flow_merges(text: str) -> None:
    s = Strategy(env={"LONGBOAT_AMP_CONFIGS": text}, amp_configs={"incr_ratio": 4})
    assert s.amp_configs["init_loss_scaling"] == 1024.0
    assert s.amp_configs["incr_ratio"] == 4.0
    assert s.source("amp_configs.init_loss_scaling") == "env:LONGBOAT_AMP_CONFIGS"
    assert s.source("amp_configs.incr_ratio") == "code"


@pytest.mark.parametrize(
    ("var", "text", "expected"),
    [
        ("LONGBOAT_NCCL_COMM_NUM", "two", "for Strategy.nccl_comm_num"),
        ("LONGBOAT_NCCL_COMM_NUM", "0", "Strategy.nccl_comm_num must be int in [1, 64], got 0"),
        ("LONGBOAT_GRADIENT_MERGE", "maybe", "true/false/1/0/yes/no"),
        ("LONGBOAT_FUSE_GRAD_SIZE_IN_MB", "-1", "must be float > 0"),
        ("LONGBOAT_MODE", "pserver", "one of 'collective', 'ps'"),
        ("LONGBOAT_AMP_CONFIGS", "[1, 2]", "must be a mapping"),
        ("LONGBOAT_AMP_CONFIGS", '{"init_loss_scale": 1}', "did you mean 'init_loss_scaling'"),
        ("LONGBOAT_AMP_CONFIGS", "{a: [", "for Strategy.amp_configs"),
        ("LONGBOAT_NUM_ITERATION_PER_RUN", "5", "remove this setting"),
    ],
)
def test_env_errors_name_the_variable(var: str, text: str, expected: str) -> None:
    with pytest.raises(StrategyError) as info:
        Strategy(env={var: text})
    message = str(info.value)
    assert message.startswith(f"environment variable {var}={text!r}: ")
    assert expected in message


def test_env_conflict_is_reported_at_use() -> None:
    s = Strategy(env={"LONGBOAT_LOCALSGD": "1"}, gradient_merge=True)
    with pytest.raises(StrategyError, match="Strategy.localsgd=True and Strategy.gradient_merge"):
        s.check()


def test_env_beats_kwargs_and_files(tmp_path: Path) -> None:
    env = {"LONGBOAT_NCCL_COMM_NUM": "2"}
    assert Strategy(env=env, nccl_comm_num=4).nccl_comm_num == 2
    path = tmp_path / "s.yaml"
    make(nccl_comm_num=4).save(path)
    loaded = Strategy.load(path, env=env)
    assert (
        loaded.nccl_comm_num == 2 and loaded.source("nccl_comm_num") == "env:LONGBOAT_NCCL_COMM_NUM"
    )
    assert Strategy.from_dict({"nccl_comm_num": 4}, env=env).nccl_comm_num == 2


def test_env_value_is_sticky_and_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    s = Strategy(env={"LONGBOAT_NCCL_COMM_NUM": "2"})
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        s.nccl_comm_num = 4
        s.nccl_comm_num = 5
    assert s.nccl_comm_num == 2
    warnings = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(warnings) == 1
    assert "Strategy.nccl_comm_num=4 is ignored" in warnings[0]
    assert "LONGBOAT_NCCL_COMM_NUM wins" in warnings[0]


def test_sticky_assignment_is_still_validated() -> None:
    s = Strategy(env={"LONGBOAT_NCCL_COMM_NUM": "2"})
    with pytest.raises(StrategyError, match="int in"):
        s.nccl_comm_num = 0
    assert s.nccl_comm_num == 2


def test_sticky_config_keeps_env_keys_and_applies_others(caplog: pytest.LogCaptureFixture) -> None:
    s = Strategy(env={"LONGBOAT_GRADIENT_MERGE_CONFIGS": '{"k_steps": 8}'})
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        s.gradient_merge_configs = {"k_steps": 2, "avg": False}
    assert dict(s.gradient_merge_configs) == {"k_steps": 8, "avg": False}
    assert any(
        "gradient_merge_configs.k_steps=2 is ignored" in r.getMessage() for r in caplog.records
    )


def test_sticky_survives_copy() -> None:
    c = Strategy(env={"LONGBOAT_NUM_THREADS": "3"}).copy()
    c.num_threads = 1
    assert c.num_threads == 3


def test_unknown_longboat_env_var_warns_with_closest_field(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        s = Strategy(env={"LONGBOAT_NCCL_COMMS_NUM": "2", "LONGBOAT_BACKEND": "gloo", "OTHER": "x"})
    messages = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(messages) == 1
    assert "LONGBOAT_NCCL_COMMS_NUM" in messages[0]
    assert "did you mean LONGBOAT_NCCL_COMM_NUM (Strategy.nccl_comm_num)" in messages[0]
    assert s.nccl_comm_num == 1


def test_known_env_vars_are_extensible(caplog: pytest.LogCaptureFixture) -> None:
    assert {"LONGBOAT_BACKEND", "LONGBOAT_TIMEOUT", "LONGBOAT_CONFIG"} <= KNOWN_ENV_VARS
    KNOWN_ENV_VARS.add("LONGBOAT_TEST_ONLY_VAR")
    try:
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            Strategy(env={"LONGBOAT_TEST_ONLY_VAR": "1"})
    finally:
        KNOWN_ENV_VARS.discard("LONGBOAT_TEST_ONLY_VAR")
    assert not [r for r in caplog.records if r.name == LOGGER]


def test_env_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LONGBOAT_NUM_THREADS", "6")
    assert Strategy().num_threads == 6


# ---- sources and printing -----------------------------------------------------------------


def test_sources() -> None:
    s = Strategy(env={"LONGBOAT_NUM_THREADS": "2"}, nccl_comm_num=2)
    s.amp_configs["incr_ratio"] = 3
    assert s.source("nccl_comm_num") == "code"
    assert s.source("num_threads") == "env:LONGBOAT_NUM_THREADS"
    assert s.source("fuse_all_reduce_ops") == "default"
    assert s.source("amp_configs") == "code"
    assert s.source("amp_configs.incr_ratio") == "code"
    with pytest.raises(StrategyError, match="did you mean 'incr_ratio'"):
        s.source("amp_configs.incr_rati")


def test_print_all_defaults() -> None:
    assert "all fields at their defaults" in str(make())


def test_print_shows_only_non_default_fields_with_sources() -> None:
    s = Strategy(env={"LONGBOAT_NCCL_COMM_NUM": "2"}, fuse_bn_act_ops=True)
    s.dgc_configs["sparsity"] = [0.5]
    text = str(s)
    assert "\x1b" not in text
    assert s.describe() == text
    assert text.isascii()
    rows = [line for line in text.splitlines() if line.count("|") == 5]
    lines = {line.split("|")[1].strip(): line for line in rows}
    assert set(lines) == {"field", "nccl_comm_num", "fuse_bn_act_ops", "dgc_configs.sparsity"}
    header = [cell.strip() for cell in lines["field"].split("|")[1:-1]]
    assert header == ["field", "value", "default", "source"]
    assert "env:LONGBOAT_NCCL_COMM_NUM" in lines["nccl_comm_num"]
    assert "[0.5]" in lines["dgc_configs.sparsity"] and "[0.999]" in lines["dgc_configs.sparsity"]
    assert "code" in lines["fuse_bn_act_ops"]


def test_print_writes_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    print(make(num_threads=2))
    assert "num_threads" in capsys.readouterr().out


# ---- generated docs -------------------------------------------------------------------------


def test_docs_contain_the_generated_reference() -> None:
    assert reference_markdown() in DOCS.read_text(encoding="utf-8"), (
        "docs/strategy.md is stale: run python -m longboat.strategy --write-docs docs/strategy.md"
    )


def test_every_field_and_config_key_is_in_the_reference_or_the_plugin_listing() -> None:
    """Declared fields are in the committed reference, the registries' fields (compressor
    settings) in the live listing of the plug-ins, and no field in both."""
    for specs, text, other in (
        (FIELDS.static, reference_markdown(), plugins_markdown()),
        (FIELDS.registered, plugins_markdown(), reference_markdown()),
    ):
        for spec in specs:
            assert f"| `{spec.name}` | {spec.group} |" in text
            assert f"| `{spec.name}` | {spec.group} |" not in other
            if spec.is_config:
                for key in spec.default:
                    assert f"| `{spec.name}` | `{key}` |" in text
    assert {s.name for s in FIELDS.static} | {s.name for s in FIELDS.registered} == set(FIELDS)


def test_cli_markdown_and_plugins(capsys: pytest.CaptureFixture[str]) -> None:
    assert strategy_main(["--markdown"]) == 0
    assert capsys.readouterr().out == reference_markdown()
    assert strategy_main(["--plugins"]) == 0
    assert capsys.readouterr().out == plugins_markdown()


def test_cli_prints_strategy_from_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "s.yaml"
    path.write_text("nccl_comm_num: 5\n")
    assert strategy_main(["--config", str(path)]) == 0
    assert "nccl_comm_num" in capsys.readouterr().out
    path.write_text("nccl_comm_num: 65\n")
    assert strategy_main(["--config", str(path)]) == 2
    assert "int in [1, 64]" in capsys.readouterr().err


def test_launcher_config_file_is_the_base_under_code_and_env(tmp_path):
    path = tmp_path / "strategy.yaml"
    path.write_text("nccl_comm_num: 3\nfuse_grad_size_in_MB: 8\nsync_nccl_allreduce: false\n")
    env = {"LONGBOAT_CONFIG": str(path), "LONGBOAT_NCCL_COMM_NUM": "2"}
    s = Strategy(env=env, fuse_grad_size_in_MB=4)
    assert s.nccl_comm_num == 2 and s.source("nccl_comm_num") == "env:LONGBOAT_NCCL_COMM_NUM"
    assert s.fuse_grad_size_in_MB == 4.0 and s.source("fuse_grad_size_in_MB") == "code"
    assert s.sync_nccl_allreduce is False and s.source("sync_nccl_allreduce") == "file"


def test_launcher_config_file_errors_name_the_file(tmp_path):
    path = tmp_path / "strategy.yaml"
    path.write_text("nccl_com_num: 3\n")
    with pytest.raises(StrategyError, match="nccl_comm_num"):
        Strategy(env={"LONGBOAT_CONFIG": str(path)})


def test_every_longboat_variable_the_package_uses_is_known():
    """A LONGBOAT_* variable set by the launcher but unknown to Strategy would warn in every rank."""
    import re

    src = Path(__file__).resolve().parents[1] / "src" / "longboat"
    used = {
        m
        for f in src.rglob("*.py")
        for m in re.findall(r"\"(LONGBOAT_[A-Z_]+)\"", f.read_text())
        if not m.endswith("_")
    }
    fields = {f"LONGBOAT_{name.upper()}" for name in FIELDS}
    assert used - KNOWN_ENV_VARS - fields == set()

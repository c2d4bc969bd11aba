"""Environment variables, --config and --log-dir: a bad one is one line before any rank starts."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

import pytest
import torch

from longboat.cluster.env import VARIABLES, check_variables, variable
from longboat.cluster.info import ClusterError
from longboat.launch import runner
from longboat.launch.options import add_arguments, spec_from_args
from longboat.strategy.changes import ENV_FIELDS, KNOWN_ENV_VARS
from tests.launch._launcher import run_launcher

SRC = Path(__file__).resolve().parents[2] / "src" / "longboat"


@pytest.fixture
def script(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in [n for n in VARIABLES if n in os.environ]:
        monkeypatch.delenv(name)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # no GPU layout check
    (tmp_path / "train.py").write_text("print('trained')\n")
    return "train.py"


def refused(capsys, monkeypatch, *argv: str) -> str:
    """Run `longboat launch ARGV` up to its checks; the one line it printed on refusal."""

    def start(*args: object, **kwargs: object) -> int:
        raise AssertionError("the launcher went on to start ranks")

    monkeypatch.setattr(runner, "launch", start)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    code = runner.run(parser.parse_args(list(argv)))
    out = capsys.readouterr().out
    assert code == 2, out
    assert len(out.strip().splitlines()) == 1, out
    return out.strip()


@pytest.mark.parametrize(
    ("name", "value", "accepted"),
    [
        ("LONGBOAT_PS_TIMEOUT", "abc", "a positive number of seconds"),
        ("LONGBOAT_TIMEOUT", "abc", "a positive number of seconds"),
        ("LONGBOAT_TIMEOUT", "0", "a positive number of seconds"),
        ("LONGBOAT_PS_MAX_CALLS", "1.5", "a whole number >= 1"),
        ("LONGBOAT_PS_CHECKPOINT_EVERY", "-2", "a whole number of steps >= 0"),
        ("LONGBOAT_PS_MAX_MESSAGE_MB", "inf", "a positive number of MB"),
        ("LONGBOAT_LOG_LEVEL", "loud", "DEBUG, INFO, WARNING, ERROR or CRITICAL"),
        ("LONGBOAT_BACKEND", "carrier-pigeon", "a process-group backend this torch build has"),
        ("LONGBOAT_SHM_DIR", "/no/such/dir", "an existing directory"),
    ],
)
def test_a_bad_variable_is_named_with_its_value_and_what_it_accepts(
    script, capsys, monkeypatch, tmp_path, name, value, accepted
):
    monkeypatch.setenv(name, value)
    line = refused(capsys, monkeypatch, "--nproc-per-node", "2", script)
    assert line.startswith(f"longboat launch: {name}={value!r} is not {accepted}"), line
    assert not (tmp_path / "log").exists()


def test_the_launcher_process_refuses_a_bad_variable(tmp_path, monkeypatch):
    (tmp_path / "train.py").write_text("print('trained')\n")
    monkeypatch.setenv("LONGBOAT_PS_TIMEOUT", "abc")
    done = run_launcher(tmp_path, "--nproc-per-node", "2", "train.py")
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout.strip() == (
        "longboat launch: LONGBOAT_PS_TIMEOUT='abc' is not a positive number of seconds, "
        "e.g. 120; fix or unset it"
    )
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "log").exists()


def test_a_variable_an_option_replaces_is_not_checked(script, monkeypatch):
    monkeypatch.setenv("LONGBOAT_TIMEOUT", "abc")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    spec = spec_from_args(parser.parse_args(["--failure-timeout", "20", script]))
    assert spec.failure_timeout == 20


def test_blank_counts_as_unset_and_good_values_pass():
    env = {
        "LONGBOAT_TIMEOUT": " 45 ",
        "LONGBOAT_PS_TIMEOUT": "",
        "LONGBOAT_BACKEND": "GLOO",
        "LONGBOAT_LOG_LEVEL": "debug",
        "LONGBOAT_ENDPOINT_PORTS": "29500,29501",
        "LONGBOAT_ALL_ENDPOINTS": "10.0.0.1:29500,[::1]:29501",
        "LONGBOAT_ROLE": "server",
        "LONGBOAT_NODE_RANK": "0",
    }
    check_variables(env)
    assert variable("LONGBOAT_TIMEOUT", env) == 45.0
    assert variable("LONGBOAT_PS_TIMEOUT", env, default=120.0) == 120.0
    assert variable("LONGBOAT_BACKEND", env) == "gloo"
    with pytest.raises(ClusterError, match="LONGBOAT_ROLE='boss' is not 'server' or 'trainer'"):
        check_variables({"LONGBOAT_ROLE": "boss"})


def test_every_longboat_variable_read_in_the_source_has_a_parser():
    """A new ``LONGBOAT_*`` variable gets its parser in longboat.cluster.variables (or is a Strategy
    field); every parsed one is known to the Strategy, which warns about unknown ones."""
    names: set[str] = set()
    for path in SRC.rglob("*.py"):
        if path.name == "changes.py" and path.parent.name == "strategy":
            continue  # the Strategy's list of known names, not readers
        names |= set(re.findall(r"\bLONGBOAT_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    placeholders = {"LONGBOAT_X"}  # docstrings' example of LONGBOAT_<FIELD>
    assert sorted(names - set(VARIABLES) - set(ENV_FIELDS) - placeholders) == []
    assert sorted(set(VARIABLES) - KNOWN_ENV_VARS) == []


def test_an_empty_config_file_is_refused(script, capsys, monkeypatch, tmp_path):
    (tmp_path / "empty.yaml").write_text("")
    (tmp_path / "comments.yaml").write_text("# nothing set yet\n\n---\n")
    for name in ("empty.yaml", "comments.yaml"):
        line = refused(capsys, monkeypatch, "--config", name, script)
        assert line == (
            f"longboat launch: --config {name} is empty (no Strategy fields); give the fields "
            "to set, or drop --config to train with the defaults"
        )


def test_a_log_dir_that_is_a_file_is_refused(script, capsys, monkeypatch, tmp_path):
    (tmp_path / "taken").write_text("a file\n")
    line = refused(capsys, monkeypatch, "--log-dir", "taken", script)
    assert line == (
        "longboat launch: --log-dir taken is a file, not a directory; give a directory "
        "(made if missing)"
    )
    line = refused(capsys, monkeypatch, "--log-dir", "taken/run1", script)
    assert f"--log-dir taken/run1 is inside {tmp_path / 'taken'}, which is a file" in line

"""`longboat launch` accepts horovodrun's -np / -H (parsing only; the examples run it)."""

from __future__ import annotations

import argparse

import pytest

from longboat.launch.options import LaunchOptionError, add_arguments, spec_from_args


def _spec(tmp_path, *argv: str):
    script = tmp_path / "train.py"
    script.write_text("")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return spec_from_args(parser.parse_args([*argv, str(script)]))


def test_np_and_local_hosts_become_ranks_on_this_node(tmp_path):
    assert _spec(tmp_path, "-np", "2", "-H", "localhost:2").nproc_per_node == 2
    assert _spec(tmp_path, "-np", "3").nproc_per_node == 3
    assert _spec(tmp_path, "-H", "127.0.0.1:4").nproc_per_node == 4
    assert _spec(tmp_path, "--num-proc", "1", "--hosts", "localhost:2").nproc_per_node == 1


def test_several_hosts_become_nodes(tmp_path):
    spec = _spec(tmp_path, "-np", "4", "-H", "127.0.0.1:2,10.9.9.9:2", "--master", ":29511")
    assert (spec.nnodes, spec.nproc_per_node, spec.node_rank) == (2, 2, 0)
    assert spec.ips == ["127.0.0.1", "10.9.9.9"] and spec.master_port == 29511


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-np", "3", "-H", "localhost:2"], "between 1 and the 2 slots"),
        (["-np", "2", "--nproc-per-node", "3"], "disagrees with --nproc-per-node"),
        (["-H", "localhost:x"], "expected host:slots"),
        (["-np", "3", "-H", "127.0.0.1:2,10.9.9.9:1"], "same number of ranks on every host"),
        (["-H", "127.0.0.1:1,10.9.9.9:1", "--ips", "127.0.0.1,10.9.9.9"], "not both"),
    ],
)
def test_bad_combinations_name_the_fix(tmp_path, argv, message):
    with pytest.raises(LaunchOptionError, match=message):
        _spec(tmp_path, *argv)

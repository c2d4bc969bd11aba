"""`longboat sim predict` on GPU clusters: units, --batch, --measured-step, described devices,
a GPU profile taken as measured, efficiencies with one decimal."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from longboat.cli import main
from tests.sim.helpers import resnet50_like

GPU = ["--nodes", "2", "--devices-per-node", "8", "--device", "V100"]


@pytest.fixture
def profile(tmp_path):  # noqa: ANN001, ANN201
    path = tmp_path / "p.json"
    resnet50_like().save(path)
    return path


def predict(profile, *args: str, tmp_path=None) -> dict:  # noqa: ANN001
    out = profile.with_name("out.json")
    assert main(["sim", "predict", "--profile", str(profile), "--json", str(out), *args]) == 0
    return json.loads(out.read_text())


def test_bits_and_bytes_on_the_command_line(profile, capsys) -> None:  # noqa: ANN001
    bits = predict(profile, *GPU, "--inter-bandwidth", "100 Gb/s")
    assert bits["cluster"]["inter"]["bandwidth"] == "12500000000.0 B/s"
    same = predict(profile, *GPU, "--inter-bandwidth", "100Gbit/s")
    assert same["prediction"] == bits["prediction"]
    bytes_ = predict(profile, *GPU, "--inter-bandwidth", "100GB/s")
    assert bytes_["cluster"]["inter"]["bandwidth"] == "100000000000.0 B/s"
    capsys.readouterr()
    code = main(["sim", "predict", "--profile", str(profile), *GPU, "--inter-bandwidth", "100gbps"])
    assert code == 2
    err = capsys.readouterr().err
    assert "ambiguous" in err and "100 Gbit/s" in err and "25 GB/s" in err


def test_batch_is_honoured_with_a_profile(profile) -> None:  # noqa: ANN001
    base = predict(profile, *GPU)
    double = predict(profile, *GPU, "--batch", str(2 * resnet50_like().batch))
    assert double["batch"] == 2 * base["batch"]
    one, two = base["sweep"][0], double["sweep"][0]
    assert two["compute_s"] == pytest.approx(2 * one["compute_s"], rel=0.02)
    assert two["samples_per_s"] == pytest.approx(one["samples_per_s"], rel=0.02)


def test_measured_step_and_compute_efficiency(profile, capsys) -> None:  # noqa: ANN001
    out = predict(profile, *GPU, "--measured-step", "250ms")
    assert "compute efficiency 0." in capsys.readouterr().out
    assert out["sweep"][0]["step_s"] == pytest.approx(0.25)
    efficiency = out["cluster"]["compute"]["efficiency"]
    again = predict(profile, *GPU, "--compute-efficiency", str(efficiency))
    assert again["sweep"][0]["step_s"] == pytest.approx(0.25)
    both = ["--measured-step", "250ms", "--compute-efficiency", "0.5"]
    assert main(["sim", "predict", "--profile", str(profile), *GPU, *both]) == 2


def test_a_gpu_that_is_not_in_the_table(profile, capsys) -> None:  # noqa: ANN001
    flags = ["--nodes", "1", "--devices-per-node", "4", "--device", "A40",
             "--intra-kind", "pcie"]  # fmt: skip
    assert main(["sim", "predict", "--profile", str(profile), *flags]) == 2
    assert "peak_flops.fp32 is required" in capsys.readouterr().err
    described = predict(profile, *flags, "--peak-flops", "fp32=37.4TFLOPS",
                        "--peak-flops", "bf16=149.7TFLOPS", "--memory-bandwidth", "696GB/s")  # fmt: skip
    assert described["cluster"]["device"]["name"] == "A40"
    assert described["backend"] == "nccl"
    amp = predict(profile, *flags, "--peak-flops", "fp32=37.4TFLOPS", "--peak-flops",
                  "bf16=149.7TFLOPS", "--memory-bandwidth", "696GB/s",
                  "--set", "amp=true", "--set", "amp_configs={dtype: bfloat16}")  # fmt: skip
    assert amp["prediction"]["compute_s"] < described["prediction"]["compute_s"]


def test_profile_device_apart_from_backend(tmp_path) -> None:  # noqa: ANN001
    path = tmp_path / "gpu.json"
    dataclasses.replace(resnet50_like(), device="cuda").save(path)
    flags = ["--nodes", "2", "--devices-per-node", "8", "--device", "profiled",
             "--intra-kind", "nvswitch", "--intra-links", "12", "--memory-bandwidth", "2TB/s"]  # fmt: skip
    taken = predict(path, *flags)
    assert taken["backend"] == "nccl"
    assert taken["prediction"]["compute_s"] >= resnet50_like().compute_s
    assert predict(path, *flags, "--backend", "gloo")["backend"] == "gloo"
    best = predict(path, *flags, "--recommend")["recommendation"]
    assert "shm" not in str(best["fields"])  # searched under NCCL rules, not Gloo's
    assert (
        predict(path, "--nodes", "2", "--devices-per-node", "2", "--device", "cpu")["backend"]
        == "gloo"
    )


def test_efficiency_printed_with_one_decimal(profile, capsys) -> None:  # noqa: ANN001
    assert main(["sim", "predict", "--profile", str(profile), *GPU]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if re.match(r"^│ +\d+ │", line)]
    assert rows and all(re.search(r"│ +\d{1,3}\.\d% │", line) for line in rows)
    assert "100.0%" in rows[0] and not any(" 100% " in line for line in rows)


def test_loader_and_spread_flags() -> None:
    import argparse

    from longboat.sim.cli import _cluster_args, cluster_from_args

    parser = argparse.ArgumentParser()
    _cluster_args(parser)
    args = parser.parse_args(
        ["--device", "V100", "--input-workers", "64", "--worker-rate", "100",
         "--device-spread", "0.02"]
    )  # fmt: skip
    c = cluster_from_args(args)
    assert (c.node_input_rate, c.device_spread) == (6400.0, 0.02)
    measured = cluster_from_args(parser.parse_args(["--device", "V100", "--input-rate", "900"]))
    assert measured.node_input_rate == 900.0

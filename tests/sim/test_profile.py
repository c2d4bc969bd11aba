"""Profiles: measured on a tiny model, saved, loaded back unchanged; bad files named."""

from __future__ import annotations

import json

import pytest

from longboat.sim import measure, profile


def test_measure_and_round_trip(tmp_path) -> None:  # noqa: ANN001
    name, model, batch = measure.load_model("mlp-tiny", None, None)
    prof = measure.measure(name, model, batch, repeats=2, warmup=1)
    assert prof.param_count == sum(p.numel() for p in model.parameters())
    assert prof.forward_s > 0 and prof.backward_s > 0 and prof.flops > 0
    ready = [p.ready_s for p in prof.params]
    assert ready[-1] <= ready[0]  # the last layer's gradient is ready first
    path = tmp_path / "p.json"
    prof.save(path)
    assert profile.load(path) == prof


def test_import_path_model_needs_a_shape() -> None:
    with pytest.raises(ValueError, match="input-shape"):
        measure.load_model("torch.nn:Identity", 4, None)
    with pytest.raises(ValueError, match="import path"):
        measure.load_model("nosuchmodel", 4, None)


def test_bad_files_are_named(tmp_path) -> None:  # noqa: ANN001
    with pytest.raises(profile.ProfileError, match="does not exist"):
        profile.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"version": 1, "model": "m"}))
    with pytest.raises(profile.ProfileError, match="missing key 'params'"):
        profile.load(bad)


def test_profile_records_where_it_was_measured(tmp_path, capsys) -> None:  # noqa: ANN001
    import torch

    from longboat.cli import main

    name, model, batch = measure.load_model("mlp-tiny", None, None)
    assert measure.measure(name, model, batch, repeats=1, warmup=0).device == "cpu"
    assert main(["sim", "profile", "--model", "mlp-tiny", "--device", "tpu", "-o",
                 str(tmp_path / "p.json")]) == 2  # fmt: skip
    assert "cpu or cuda" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            measure.measure(name, model, batch, repeats=1, warmup=0, device="cuda")


@pytest.mark.gpu
def test_profile_on_cuda() -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    name, model, batch = measure.load_model("mlp-tiny", None, None)
    prof = measure.measure(name, model, batch, repeats=2, warmup=1, device="cuda")
    assert prof.device == "cuda" and prof.forward_s > 0 and prof.backward_s > 0
    ready = [p.ready_s for p in prof.params]
    assert all(0 <= r <= prof.backward_s * 1.01 for r in ready)

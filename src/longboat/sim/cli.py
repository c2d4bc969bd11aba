"""`longboat sim`: predict step time, scaling and the best Strategy before booking a cluster.

longboat sim profile --model resnet -o resnet.json          # measure the model here
longboat sim calibrate [--emulate 1gbit] -o here.yaml        # fit this machine's links
longboat sim predict --profile resnet.json --cluster c.yaml  # step time, sweep, plot
    [--batch 256] [--measured-step 104ms] [--measured-step-at 16=120ms]
    [--strategy s.yaml] [--set nccl_comm_num=2]
    [--max-devices 4096] [--png eff.png] [--recommend [--lossy | --exact] [--write best.yaml]]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from longboat.sim import cluster as cluster_mod


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="sim_command", required=True, metavar="STEP")
    prof = sub.add_parser("profile", help="measure a model's per-parameter compute profile here")
    _model_args(prof)
    prof.add_argument("--repeats", type=int, default=10, help="timed steps (default 10)")
    prof.add_argument("--warmup", type=int, default=3, help="discarded steps (default 3)")
    prof.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    prof.add_argument("--amp", action="store_true", help="forward under bfloat16 autocast")
    prof.add_argument(
        "--device",
        default="cpu",
        help="measure on cpu (default) or cuda; a CUDA profile is taken as measured with "
        "`predict --device profiled`",
    )
    prof.add_argument("-o", "--output", required=True, help="profile JSON to write")
    cal = sub.add_parser(
        "calibrate", help="fit link parameters to this machine (and emulated links)"
    )
    cal.add_argument("--nproc", type=int, default=2, help="local ranks (default 2)")
    cal.add_argument(
        "--emulate",
        default=None,
        metavar="RATE",
        help="also measure two emulated nodes at this tc rate (root), e.g. 1gbit",
    )
    cal.add_argument("--repeats", type=int, default=7, help="timed repeats per size (default 7)")
    cal.add_argument("-o", "--output", required=True, help="cluster YAML to write")
    pred = sub.add_parser("predict", help="step time, scaling sweep, plot and --recommend")
    src = pred.add_mutually_exclusive_group(required=True)
    src.add_argument("--profile", help="a profile JSON from `longboat sim profile`")
    _model_args(pred, group=src)
    _cluster_args(pred)
    pred.add_argument(
        "--measured-step",
        default=None,
        metavar="TIME",
        help="one device's measured step time at the profile's batch (or --batch), e.g. 104ms: "
        "fits the compute efficiency",
    )
    pred.add_argument(
        "--measured-step-at",
        default=None,
        metavar="DEVICES=TIME",
        help="a measured step on that many devices, e.g. 16=120ms (measure where collectives "
        "overlap backward, on the links you predict for): fits the contention, after "
        "--measured-step",
    )
    pred.add_argument("--strategy", default=None, help="Strategy YAML/JSON (as for training)")
    pred.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="a Strategy field (YAML value), repeatable",
    )
    pred.add_argument(
        "--max-devices",
        type=int,
        default=None,
        help="sweep N = 1, 2, 4 ... up to this (default: the cluster's devices)",
    )
    pred.add_argument("--png", default=None, help="plot scaling efficiency vs devices")
    pred.add_argument("--json", default=None, help="write predictions as JSON")
    pred.add_argument(
        "--recommend", action="store_true", help="search Strategy settings for the lowest step time"
    )
    precision = pred.add_mutually_exclusive_group()
    precision.add_argument(
        "--lossy", action="store_true", help="with --recommend: also PowerSGD, DGC, local SGD"
    )
    precision.add_argument(
        "--exact",
        action="store_true",
        help="with --recommend: no gradient compression (bf16/fp16 excluded too)",
    )
    pred.add_argument("--top", type=int, default=5, help="with --recommend: rows shown (default 5)")
    pred.add_argument(
        "--write",
        default=None,
        metavar="FILE",
        help="with --recommend: write the best Strategy YAML",
    )


def _model_args(p: argparse.ArgumentParser, group: Any = None) -> None:
    (group or p).add_argument(
        "--model",
        required=group is None,
        help="a `longboat bench` model (mlp, convnet, resnet, transformer, ...) or pkg.module:factory",
    )
    p.add_argument(
        "--batch",
        type=int,
        default=None,
        help="batch per rank (default: the model's or the profile's; with --profile compute "
        "scales from the profile's batch)",
    )
    p.add_argument(
        "--input-shape",
        default=None,
        help="one sample's shape for pkg.module:factory, e.g. 3,224,224",
    )


def _cluster_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cluster", default=None, help="cluster YAML (see docs/sim.md)")
    p.add_argument("--nodes", type=int, default=None)
    p.add_argument("--devices-per-node", type=int, default=None)
    p.add_argument(
        "--device",
        default=None,
        help="cpu (the profile's times, Gloo), profiled (the profile's times, backend from where "
        "it was measured), V100, A100, H100, H200 (SXM), A100-PCIe, H100-PCIe, L40S, A10, L4 "
        "(PCIe cards), or any name with --peak-flops and --memory-bandwidth",
    )
    p.add_argument(
        "--peak-flops",
        action="append",
        default=[],
        metavar="PRECISION=RATE",
        help="the device's dense peak, e.g. fp32=19.5TFLOPS, bf16=312TFLOPS (repeatable; "
        "precisions fp32, tf32, fp16, bf16)",
    )
    p.add_argument(
        "--memory-bandwidth", default=None, help="the device's memory bandwidth, e.g. 2039GB/s"
    )
    p.add_argument("--precision", default=None, choices=("fp32", "tf32"), help="non-AMP math")
    p.add_argument("--backend", default=None, choices=cluster_mod.BACKENDS)
    p.add_argument("--intra-kind", default=None, choices=cluster_mod.INTRA_KINDS)
    p.add_argument("--intra-bandwidth", default=None, help="per device, all links, e.g. 300GB/s")
    p.add_argument("--intra-links", type=int, default=None, help="NVLink ports per device")
    p.add_argument(
        "--intra-link-bandwidth", default=None, help="per NVLink port and direction, e.g. 25GB/s"
    )
    p.add_argument("--intra-latency", default=None, help="e.g. 3us")
    p.add_argument(
        "--intra-group",
        type=int,
        default=None,
        metavar="N",
        help="with --intra-kind nvlink: NVLink joins groups of this many devices (bridged pairs "
        "on PCIe servers: 2); a job wider than a group crosses PCIe",
    )
    p.add_argument("--inter-bandwidth", default=None, help="per NIC, e.g. 100Gb/s or 25GB/s")
    p.add_argument("--inter-latency", default=None, help="e.g. 5us")
    p.add_argument("--nics-per-node", type=int, default=None)
    p.add_argument(
        "--gpudirect",
        default=None,
        choices=("on", "off"),
        help="GPUDirect RDMA between NICs and GPUs (default on)",
    )
    p.add_argument(
        "--compute-efficiency", type=float, default=None, help="fraction of peak FLOP/s, (0, 1]"
    )
    p.add_argument(
        "--jitter",
        type=float,
        default=None,
        help="coefficient of variation of one rank's compute per step (stragglers)",
    )
    p.add_argument(
        "--device-spread",
        type=float,
        default=None,
        help="coefficient of variation of the devices' persistent speeds (stragglers)",
    )
    p.add_argument(
        "--contention",
        type=float,
        default=None,
        help="slowdown of backward while collectives run beside it (0.1 = 10 %%)",
    )
    p.add_argument(
        "--input-rate",
        type=float,
        default=None,
        metavar="SAMPLES_PER_S",
        help="samples/s one node's input pipeline delivers (measured)",
    )
    p.add_argument(
        "--input-workers",
        type=int,
        default=None,
        metavar="N",
        help="data-loader processes on a node (instead of --input-rate)",
    )
    p.add_argument(
        "--worker-rate",
        type=float,
        default=None,
        metavar="SAMPLES_PER_S",
        help="samples/s one loader process delivers (default 130: ImageNet decode and crop)",
    )
    p.add_argument("--ps-servers", type=int, default=None, help="parameter servers (ps section)")


def _device_entry(args: argparse.Namespace, data: dict[str, Any]) -> Any:
    """The cluster's ``device`` value with --device, --peak-flops and --memory-bandwidth."""
    from longboat.sim import devices

    current = data.get("device", "cpu")
    if args.device is not None:
        name, spec = args.device, {}
    elif isinstance(current, dict):
        name, spec = current["name"], dict(current)
    else:
        name, spec = current, {}
    peaks = {}
    for item in args.peak_flops:
        precision, sep, rate = item.partition("=")
        if not sep:
            raise cluster_mod.ClusterError(
                f"--peak-flops {item!r}: expected PRECISION=RATE, e.g. bf16=312TFLOPS"
            )
        peaks[precision.strip()] = rate.strip()
    if name in cluster_mod.HOST_DEVICES:
        if peaks:
            raise cluster_mod.ClusterError(
                f"--peak-flops describes a GPU; device {name} uses the profile's own times"
            )
        return name
    if peaks:
        spec["peak_flops"] = dict(spec.get("peak_flops") or {}) | peaks
    if args.memory_bandwidth is not None:
        spec["memory_bandwidth"] = args.memory_bandwidth
    if not spec and devices.known(name):
        return name
    return spec | {"name": name}


def _input_entry(args: argparse.Namespace, data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with its ``input`` section replaced by --input-rate or --input-workers and
    --worker-rate, where given."""
    flags = {
        "samples_per_s": args.input_rate,
        "workers": args.input_workers,
        "worker_samples_per_s": args.worker_rate,
    }
    given = {key: value for key, value in flags.items() if value is not None}
    if not given:
        return data
    entry = dict(data.get("input") or {})
    if "samples_per_s" in given:
        entry.pop("workers", None)
        entry.pop("worker_samples_per_s", None)
    else:
        entry.pop("samples_per_s", None)
    return data | {"input": entry | given}


#: ``--flag`` -> (section, key) of the cluster description it sets.
_SECTION_FLAGS = (
    ("intra_kind", "intra", "kind"),
    ("intra_bandwidth", "intra", "bandwidth"),
    ("intra_links", "intra", "links"),
    ("intra_link_bandwidth", "intra", "link_bandwidth"),
    ("intra_latency", "intra", "latency"),
    ("intra_group", "intra", "group"),
    ("inter_bandwidth", "inter", "bandwidth"),
    ("inter_latency", "inter", "latency"),
    ("nics_per_node", "inter", "nics_per_node"),
    ("compute_efficiency", "compute", "efficiency"),
    ("precision", "compute", "precision"),
    ("jitter", "compute", "jitter"),
    ("device_spread", "compute", "device_spread"),
    ("contention", "compute", "contention"),
)


def cluster_from_args(args: argparse.Namespace) -> cluster_mod.Cluster:
    """The ``--cluster`` file with the flags on top (flags alone need nodes and devices)."""
    data = _base_entries(args)
    data["device"] = _device_entry(args, data)
    if args.memory_bandwidth is not None and not isinstance(data["device"], dict):
        data["memory_bandwidth"] = args.memory_bandwidth
    sections = {
        "intra": _intra_entry(args, data),
        "inter": dict(data.get("inter") or {}),
        "compute": dict(data.get("compute") or {}),
    }
    for flag, section, key in _SECTION_FLAGS:
        if getattr(args, flag) is not None:
            sections[section][key] = getattr(args, flag)
    if args.gpudirect is not None:
        sections["inter"]["gpudirect"] = args.gpudirect == "on"
    data.update({key: value for key, value in sections.items() if value})
    data = _input_entry(args, data)
    if args.ps_servers:
        data["ps"] = dict(data.get("ps") or {}) | {"servers": args.ps_servers}
    return cluster_mod.from_dict(data, where=args.cluster or "flags")


def _base_entries(args: argparse.Namespace) -> dict[str, Any]:
    """The ``--cluster`` file's entries (else one cpu device), with ``--nodes``,
    ``--devices-per-node`` and ``--backend`` on top; ``--device`` without a file drops the
    intra link (the device's own applies)."""
    if args.cluster:
        data = cluster_mod.load(args.cluster).to_dict()
    else:
        data = {"nodes": 1, "devices_per_node": 1}
        if args.device is None:
            data["device"] = "cpu"
    for key in ("nodes", "devices_per_node", "backend"):
        if getattr(args, key) is not None:
            data[key] = getattr(args, key)
    if args.device is not None and not args.cluster:
        data.pop("intra", None)
    return data


def _intra_entry(args: argparse.Namespace, data: dict[str, Any]) -> dict[str, Any]:
    """The intra section without the entries the ``--intra-*`` flags replace: a bandwidth
    given one way drops the other way's, a new kind drops the old kind's figures."""
    intra = dict(data.get("intra") or {})
    if args.intra_links is not None or args.intra_link_bandwidth is not None:
        intra.pop("bandwidth", None)
    if args.intra_bandwidth is not None:
        intra.pop("link_bandwidth", None)
    if args.intra_kind is not None and args.intra_kind != intra.get("kind"):
        for key in ("bandwidth", "links", "link_bandwidth", "group", "pcie_bandwidth"):
            intra.pop(key, None)
    return intra


def _fit_contention(
    prof: Any, cl: cluster_mod.Cluster, strategy: Any, args: argparse.Namespace
) -> cluster_mod.Cluster:
    """``cl`` with the contention fitted to ``--measured-step-at DEVICES=TIME``."""
    from longboat.sim.fit import contention
    from longboat.sim.units import duration

    if args.contention is not None:
        raise ValueError("--measured-step-at fits the contention: drop one of the two")
    devices, sep, time = args.measured_step_at.partition("=")
    if not sep or not devices.strip().isdigit():
        raise ValueError(
            f"--measured-step-at: {args.measured_step_at!r} is not DEVICES=TIME, e.g. 16=120ms"
        )
    step = duration(time.strip(), "--measured-step-at")
    value = contention(prof, cl.with_devices(int(devices)), step, strategy)
    print(
        f"contention {value:.4f}: {int(devices)} {cl.device} take {step * 1e3:.4g} ms per step "
        f"of {prof.model} at batch {prof.batch} (used at every device count)"
    )
    return dataclasses.replace(cl, contention=value)


def _strategy(path: str | None, sets: list[str]) -> Any:
    from longboat.strategy import Strategy
    from longboat.tools.bench.train import strategy_fields

    return Strategy(**strategy_fields(path, sets))


def _profile(args: argparse.Namespace, show: bool) -> Any:
    from longboat.sim import measure, profile
    from longboat.tools.progress import progress

    if getattr(args, "profile", None):
        loaded = profile.load(args.profile)
        return loaded.with_batch(args.batch) if args.batch is not None else loaded
    shape = [int(d) for d in args.input_shape.split(",")] if args.input_shape else None
    name, model, batch = measure.load_model(args.model, args.batch, shape)
    repeats, warmup = getattr(args, "repeats", 10), getattr(args, "warmup", 3)
    with progress("sim profile", repeats + warmup, show) as done:
        return measure.measure(
            name,
            model,
            batch,
            repeats,
            warmup,
            getattr(args, "threads", 1),
            getattr(args, "amp", False),
            done,
            getattr(args, "device", "cpu") if args.sim_command == "profile" else "cpu",
        )


def run(args: argparse.Namespace) -> int:
    from longboat.sim import report

    try:
        if args.sim_command == "profile":
            prof = _profile(args, True)
            prof.save(args.output)
            report.profile_summary(prof, args.output)
            return 0
        if args.sim_command == "calibrate":
            from longboat.sim.calibrate import calibrate

            fitted = calibrate(args.nproc, args.emulate, args.repeats)
            cluster_mod.save(fitted, args.output)
            report.cluster_summary(fitted, args.output)
            return 0
        return _predict(args)
    except (ValueError, RuntimeError) as exc:
        print(f"longboat sim: {exc}", file=sys.stderr)
        return 2


def _predict(args: argparse.Namespace) -> int:
    from longboat.sim import report
    from longboat.sim.predict import simulate
    from longboat.sim.recommend import recommend, to_yaml, verdict
    from longboat.sim.sweep import device_counts, plot, sweep

    prof = _profile(args, True)
    cl = cluster_from_args(args)
    strategy = _strategy(args.strategy, args.set)
    if args.measured_step is not None:
        from longboat.sim.fit import calibrated
        from longboat.sim.units import duration

        if args.compute_efficiency is not None:
            raise ValueError("--measured-step fits the compute efficiency: drop one of the two")
        step = duration(args.measured_step, "--measured-step")
        cl = calibrated(prof, cl, step, strategy)
        print(
            f"compute efficiency {cl.compute_efficiency:.4f}: one {cl.device} takes "
            f"{step * 1e3:.4g} ms per step of {prof.model} at batch {prof.batch}"
        )
    if args.measured_step_at is not None:
        cl = _fit_contention(prof, cl, strategy, args)
    here = simulate(prof, cl, strategy)
    report.breakdown(prof, cl, here)
    max_devices = args.max_devices or cl.world
    big = (
        cl
        if max_devices <= cl.world
        else dataclasses.replace(cl, nodes=-(-max_devices // cl.devices_per_node))
    )
    points = sweep(prof, big, strategy, device_counts(cl, max_devices))
    report.sweep_table(points, prof.model)
    out: dict[str, Any] = {
        "profile": prof.model,
        "cluster": cl.to_dict(),
        "backend": cl.resolved_backend(prof.device),
        "batch": prof.batch,
        "prediction": here.to_dict(),
        "sweep": [
            p.prediction.to_dict() | {"speedup": p.speedup, "efficiency": p.efficiency}
            for p in points
        ],
    }
    series = {"strategy": points}
    if args.recommend:
        choices = recommend(prof, cl, args.lossy, args.top, exact=args.exact)
        report.recommend_table(choices, here)
        print(verdict(choices, prof, cl))
        best = choices[0]
        text = to_yaml(
            best,
            f"longboat sim --recommend: {prof.model} on {cl.world} device(s), predicted {best.prediction.step_s * 1e3:.3f} ms/step",
        )
        print(text)
        if args.write:
            with open(args.write, "w") as f:
                f.write(text)
            from longboat.strategy import Strategy

            Strategy.load(args.write)
        out["recommendation"] = {"fields": best.fields, "prediction": best.prediction.to_dict()}
        series["recommended"] = sweep(prof, big, best.strategy, device_counts(cl, max_devices))
    if args.png:
        plot(series, args.png, f"{prof.model}: predicted scaling efficiency")
        print(f"plot: {args.png}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0

"""`--recommend`: the Strategy settings with the lowest predicted step time on a cluster.

Candidates: every applicable allreduce algorithm x bucket caps x communicator counts x
{no compression, each registered compressor that declares a cost and is not lossy (the
half-precision casts)}; with ``lossy=True`` also the lossy compressors and local SGD (they change
the training dynamics, so they are only proposed when asked); with ``exact=True`` no
compression at all (a cast rounds every gradient, so only the settings that send the gradients
as they are remain: the training result is that of the default Strategy up to summation order);
parameter servers (sync) when the cluster has a ``ps`` section; sharding stages 1 and 2, and
stage 3 (parameters split too, FSDP2) only where nothing else fits the devices' memory. Each
candidate is a real Strategy (conflicts refused as in training).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import yaml

from longboat.collective.plan import resolve_compression
from longboat.registry import COMPRESSORS
from longboat.sim import cost
from longboat.sim.cluster import Cluster
from longboat.sim.error import known_error
from longboat.sim.predict import Prediction, collective_plan, resolve, simulate
from longboat.sim.profile import Profile
from longboat.strategy import Strategy, StrategyError
from longboat.strategy.registered import COMPRESSION_FIELD
from longboat.tools.progress import progress

CAPS_MB = (1, 2, 4, 16, 32, 64, 128)
COMMS = (1, 2, 4)
TIE = 0.005  # relative step-time difference treated as a tie
FIT = 0.8  # share of device memory the model state may take (activations need the rest)


@dataclass(frozen=True)
class Choice:
    fields: dict[str, Any]
    prediction: Prediction

    @property
    def strategy(self) -> Strategy:
        return Strategy(**self.fields)


def candidates(cluster: Cluster, lossy: bool = False, exact: bool = False) -> list[dict[str, Any]]:
    """Strategy fields to try, the default Strategy (``{}``) first."""
    if lossy and exact:
        raise ValueError("lossy and exact exclude each other")
    algorithms = cost.candidates(cluster)
    compressions: list[dict[str, Any]] = [{}]
    if not exact:
        compressions += compressor_fields(lossy=False)
    if lossy:
        compressions += compressor_fields(lossy=True)
    out: list[dict[str, Any]] = [{}]
    for algo, cap, comms, comp in itertools.product(algorithms, CAPS_MB, COMMS, compressions):
        fields = {"allreduce_algorithm": algo, "fuse_grad_size_in_MB": float(cap)}
        out.append(fields | {"nccl_comm_num": comms} | comp)
    if lossy:
        for algo, k in itertools.product(algorithms, (2, 4, 8)):
            out.append(
                {"allreduce_algorithm": algo, "localsgd": True, "localsgd_configs": {"k_steps": k}}
            )
    if cluster.world > 1:  # the same results, less memory per rank
        out += [{"sharding": True, "sharding_configs": {"stage": s}} for s in (1, 2)]
    if cluster.ps is not None:
        out.append({"mode": "ps", "a_sync": False})
    return out


def stage3_candidates(exact: bool = False) -> list[dict[str, Any]]:
    """Sharding stage 3 (FSDP2) at each bucket cap (the cap chooses its units), and unless
    ``exact`` with each half-precision reduce dtype: tried only when nothing else fits."""
    reduce: list[dict[str, Any]] = [{}] if exact else [{}, *compressor_fields(lossy=False)]
    return [
        {"sharding": True, "sharding_configs": {"stage": 3}, "fuse_grad_size_in_MB": float(cap)}
        | comp
        for cap, comp in itertools.product(CAPS_MB, reduce)
    ]


def compressor_fields(lossy: bool) -> list[dict[str, Any]]:
    """The Strategy fields selecting each registered compressor that declares a cost, other
    than the default Strategy's, whose ``lossy`` trait is ``lossy``, by name (one priced as
    uncompressed would only repeat the uncompressed candidates)."""
    default = resolve_compression(Strategy()).name
    return [
        {e.switch: True} if e.switch else {COMPRESSION_FIELD: e.name}
        for e in COMPRESSORS.entries()
        if e.cost is not None and e.lossy is lossy and e.name != default
    ]


def recommend(
    profile: Profile,
    cluster: Cluster,
    lossy: bool = False,
    top: int = 5,
    show: bool = True,
    exact: bool = False,
) -> list[Choice]:
    """The ``top`` candidates: those within ``TIE`` of the fastest first, the fewest changed
    settings first (a predicted gain below ``TIE`` is no reason to change a setting), then the
    rest, fastest first; but the default Strategy first wherever the best candidate's predicted
    gain over it is within the simulator's known error on ``cluster``
    (`longboat.sim.error.known_error`; `verdict` says which). Fields equal to what the default
    Strategy runs with on ``cluster`` (topology-chosen settings resolved) are dropped."""
    cluster = resolve(cluster, profile)  # the backend the profile implies (device: profiled)
    default = collective_plan(Strategy(), cluster).comm
    defaults = Strategy().to_dict() | {
        "allreduce_algorithm": default.algorithm,
        "fuse_grad_size_in_MB": default.bucket_mb,
        "nccl_comm_num": default.communicators,
    }

    def priced(fields_list: list[dict[str, Any]], label: str) -> list[Choice]:
        out = []
        with progress(label, len(fields_list), show) as done:
            for fields in fields_list:
                done()
                try:
                    strategy = Strategy(**fields)
                    strategy.check()  # conflicts are checked at use, not on construction
                except (StrategyError, NotImplementedError):
                    continue
                changed = {k: v for k, v in fields.items() if k not in defaults or defaults[k] != v}
                out.append(Choice(changed, simulate(profile, cluster, strategy)))
        return out

    choices = priced(candidates(cluster, lossy, exact), "sim recommend")
    if not fit(choices, cluster) and cluster.world > 1:  # only then split the parameters too
        choices += priced(stage3_candidates(exact), "sim recommend stage 3")
    choices = fitting(choices, cluster)
    if not choices:
        return []
    best = min(c.prediction.step_s for c in choices)

    def order(c: Choice) -> tuple[bool, int, float]:
        near = c.prediction.step_s <= best * (1 + TIE)
        return (not near, len(c.fields) if near else 0, c.prediction.step_s)

    ranked = sorted(choices, key=order)
    default = next((c for c in ranked if not c.fields), None)
    if default is not None and gain(default, ranked[0]) <= known_error(cluster).median:
        ranked = [default, *(c for c in ranked if c is not default)]
    return ranked[:top]


def percent(fraction: float) -> str:
    return f"{fraction * 100:.1f} %"


def gain(current: Choice, other: Choice) -> float:
    """How much less time a step of ``other`` is predicted to take than one of ``current``."""
    return 1.0 - other.prediction.step_s / current.prediction.step_s


def verdict(choices: list[Choice], profile: Profile, cluster: Cluster) -> str:
    """What `recommend`'s ``choices`` say, in one line: the change and its predicted gain over
    the default Strategy beyond the simulator's known error on ``cluster``, or that no change
    is predicted beyond it (the best candidate's gain, and the error it falls within)."""
    error = known_error(resolve(cluster, profile))
    if not choices:
        return "no Strategy to recommend"
    first = choices[0]
    if first.fields:
        default = simulate(profile, cluster, Strategy())
        ahead = 1.0 - first.prediction.step_s / default.step_s
        return (
            f"recommended: predicted {percent(ahead)} faster than the default Strategy, beyond "
            f"the simulator's error ({error})"
        )
    faster = [c for c in choices[1:] if gain(first, c) > 0]
    if not faster:
        return "the default Strategy is predicted fastest: keep the settings"
    best = min(faster, key=lambda c: c.prediction.step_s)
    return (
        f"no change predicted beyond the simulator's error ({percent(error.median)}): keep "
        f"the settings; the best change is predicted {percent(gain(first, best))} faster, "
        f"within the error ({error})"
    )


def fit(choices: list[Choice], cluster: Cluster) -> list[Choice]:
    """The choices whose model state (parameters, gradients, optimizer state, and at stage 3
    the units gathered) takes at most `FIT` of a GPU's memory; all of them where the device's
    memory is unknown."""
    capacity = cluster.spec.memory if cluster.is_gpu else 0.0
    if not capacity:
        return choices
    return [c for c in choices if sum(c.prediction.memory.values()) <= FIT * capacity]


def fitting(choices: list[Choice], cluster: Cluster) -> list[Choice]:
    """`fit`'s choices; ValueError when none fits, naming what the leanest one needs."""
    kept = fit(choices, cluster)
    if choices and not kept:
        capacity = cluster.spec.memory
        least = min(sum(c.prediction.memory.values()) for c in choices)
        raise ValueError(
            f"no Strategy tried fits: the leanest needs {least / 1e9:.1f} GB of model state per "
            f"rank (parameters, gradients, Adam's state; activations come on top), over "
            f"{FIT:.0%} of the {capacity / 1e9:.0f} GB of a {cluster.spec.name}; use more "
            "devices (sharding splits the state over them), larger devices, or sharding stage "
            "3 with sharding_configs['offload'] (the shards in host memory)"
        )
    return kept


def to_yaml(choice: Choice, header: str = "") -> str:
    """The choice as a Strategy YAML file (`longboat launch --config`, `Strategy.load`)."""
    lines = [f"# {line}" for line in header.splitlines()] if header else []
    if not choice.fields:
        lines.append("# every field at its default is best")
    body = yaml.safe_dump(choice.fields, sort_keys=False)
    return "\n".join([*lines, body]) if lines else body

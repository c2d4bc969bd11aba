"""A model's compute profile: forward, backward and optimizer times, and when each gradient
becomes ready during backward, saved as JSON."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from longboat.collective.buckets import GradSpec

VERSION = 1


class ProfileError(ValueError):
    """A profile file that cannot be read."""


@dataclass(frozen=True)
class Param:
    """One parameter: its size and when (seconds after backward started) its grad was ready."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    layer: str
    ready_s: float

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * getattr(torch, self.dtype).itemsize


@dataclass(frozen=True)
class Profile:
    """Per-rank compute of one training step (registration order for ``params``)."""

    model: str
    batch: int
    forward_s: float
    backward_s: float
    optimizer_s: float
    flops: float  # forward + backward, per step of one rank
    params: tuple[Param, ...]
    layers: dict[str, float] = field(default_factory=dict)  # leaf module -> forward seconds
    threads: int = 1
    amp: bool = False
    host: str = ""
    device: str = "cpu"  # where it was measured: cpu or cuda
    #: every submodule by name (``named_modules`` order): its class name, the class's Python
    #: module, the container it derives from ("Sequential", "ModuleList", "ModuleDict" or "")
    #: and whether the class has a forward of its own; sharding stage 3's units are planned
    #: on this tree (`longboat.sim.stage3_units`); empty in profiles measured before
    modules: dict[str, list[Any]] = field(default_factory=dict)

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s

    @property
    def param_count(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def grad_bytes(self) -> int:
        return sum(p.nbytes for p in self.params)

    def grad_specs(self) -> list[GradSpec]:
        """The planner's view of the parameters, as ``lb.distribute`` builds it."""
        cpu = torch.device("cpu")
        return [
            GradSpec(i, p.name, p.numel, getattr(torch, p.dtype), cpu, p.layer)
            for i, p in enumerate(self.params)
        ]

    def scaled(self, factor: float, optimizer_s: float | None = None) -> Profile:
        """Compute times multiplied by ``factor`` (and the optimizer replaced, if given)."""
        params = tuple(
            Param(p.name, p.shape, p.dtype, p.layer, p.ready_s * factor) for p in self.params
        )
        return Profile(
            self.model,
            self.batch,
            self.forward_s * factor,
            self.backward_s * factor,
            self.optimizer_s * factor if optimizer_s is None else optimizer_s,
            self.flops,
            params,
            {k: v * factor for k, v in self.layers.items()},
            self.threads,
            self.amp,
            self.host,
            self.device,
            self.modules,
        )

    def with_batch(self, batch: int) -> Profile:
        """The profile at another batch per rank: FLOPs and compute times scale with the batch
        (the optimizer does not); a profile's per-layer launch costs are not separated, so a
        batch far from the measured one is an extrapolation."""
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ProfileError(f"batch must be a positive integer, got {batch!r}")
        if batch == self.batch:
            return self
        factor = batch / self.batch
        scaled = self.scaled(factor, optimizer_s=self.optimizer_s)
        return dataclasses.replace(scaled, batch=batch, flops=self.flops * factor)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["version"] = VERSION
        for p in out["params"]:
            p["shape"] = list(p["shape"])
        return out

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))


def from_dict(data: dict[str, Any], where: str = "profile") -> Profile:
    """Build a profile from :meth:`Profile.to_dict`'s shape; errors name the missing key."""
    if data.get("version") != VERSION:
        raise ProfileError(f"{where}: version {data.get('version')!r}, expected {VERSION}")
    try:
        params = tuple(
            Param(
                p["name"],
                tuple(int(d) for d in p["shape"]),
                p["dtype"],
                p["layer"],
                float(p["ready_s"]),
            )
            for p in data["params"]
        )
        for p in params:
            if not isinstance(getattr(torch, p.dtype, None), torch.dtype):
                raise ProfileError(f"{where}: parameter {p.name!r} has unknown dtype {p.dtype!r}")
        return Profile(
            model=str(data["model"]),
            batch=int(data["batch"]),
            forward_s=float(data["forward_s"]),
            backward_s=float(data["backward_s"]),
            optimizer_s=float(data["optimizer_s"]),
            flops=float(data["flops"]),
            params=params,
            layers={str(k): float(v) for k, v in data.get("layers", {}).items()},
            threads=int(data.get("threads", 1)),
            amp=bool(data.get("amp", False)),
            host=str(data.get("host", "")),
            device=str(data.get("device", "cpu")),
            modules={str(k): list(v) for k, v in data.get("modules", {}).items()},
        )
    except KeyError as exc:
        raise ProfileError(f"{where}: missing key {exc.args[0]!r}") from None


def load(path: str | Path) -> Profile:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ProfileError(f"profile file {str(path)!r} does not exist") from None
    except json.JSONDecodeError as exc:
        raise ProfileError(f"{path}: not JSON: {exc}") from None
    return from_dict(data, where=str(path))

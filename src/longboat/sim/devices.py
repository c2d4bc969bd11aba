"""Published peak figures of a few accelerators, and the efficiency model that turns a profile
measured on this machine into compute times on one of them.

Model: a step's forward+backward takes ``flops / (peak * efficiency) + layers * launch``
on the device (``peak``: the dense float32 figure, or the float16/bfloat16 tensor-core figure
with AMP; ``efficiency``: the fraction of peak a real model sustains, 0.5 by default; ``launch``:
a fixed cost per layer and pass). That total is spread over the step in the proportions the
profile measured, so the order and spacing of gradient-ready times are kept. The optimizer is
memory-bound: ``5 x 4`` bytes per parameter (read weight, grad, momentum; write weight, momentum)
at 80 % of the memory bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Device:
    name: str
    fp32_flops: float  # dense, no tensor cores
    half_flops: float  # dense float16/bfloat16 tensor cores
    memory_bandwidth: float  # bytes/s
    nvlink_bandwidth: float  # bytes/s per direction per device


#: SXM parts, vendor data sheets (dense figures, no sparsity).
DEVICES: dict[str, Device] = {
    "V100": Device("V100", 15.7e12, 125e12, 900e9, 150e9),
    "A100": Device("A100", 19.5e12, 312e12, 2039e9, 300e9),
    "H100": Device("H100", 67e12, 989e12, 3350e9, 450e9),
}

LAUNCH_S = 5e-6
OPTIMIZER_BYTES_PER_PARAM = 20
MEMORY_EFFICIENCY = 0.8


def get(name: str) -> Device:
    """The device called ``name`` (case-insensitive)."""
    for key, device in DEVICES.items():
        if key.lower() == name.lower():
            return device
    raise KeyError(f"unknown device {name!r}; choose cpu or one of {', '.join(DEVICES)}")


def compute_seconds(
    flops: float, layers: int, device: Device, efficiency: float, amp: bool
) -> float:
    """Forward+backward seconds of ``flops`` on ``device`` (see the module docstring)."""
    peak = device.half_flops if amp else device.fp32_flops
    return flops / (peak * efficiency) + 2 * layers * LAUNCH_S


def optimizer_seconds(params: int, device: Device) -> float:
    """Seconds of one momentum-SGD update of ``params`` float32 parameters."""
    return params * OPTIMIZER_BYTES_PER_PARAM / (device.memory_bandwidth * MEMORY_EFFICIENCY)

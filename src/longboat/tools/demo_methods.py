"""The demo's training methods: one Strategy per optimisation (compression, local SGD, AMP).

``longboat demo --method NAME`` trains the demo task with one of them, and
``benchmarks/compression_accuracy.py`` compares all of them with ``baseline`` (accuracy and
gradient bytes per step). The ``EXACT`` ones must equal single-process training (``sharding``
splits the optimizer state and gradients, not the arithmetic); the others change the
arithmetic on purpose and are judged by accuracy.
"""

from __future__ import annotations

from typing import Any

# an epoch of the demo is 23 steps: DGC stays dense for the first one, then ramps up over two;
# fc1 (32768 weights) and conv2 (4608) are sparsified. Sparsifying the small fc2 (640) and
# conv1 (144) too (min_numel 128) cuts the last step's bytes from 2.6 % to 0.55 % of dense
# but costs 2 points of accuracy on this tiny model (docs/BENCHMARKS.md)
_DGC_RAMP = {
    "rampup_begin_step": 23,
    "rampup_step": 46,
    "sparsity": [0.75, 0.9375, 0.984375, 0.996, 0.999],
    "min_numel": 1024,
}

METHODS: dict[str, dict[str, Any]] = {
    "baseline": {},
    "fp16_allreduce": {"fp16_allreduce": True},
    "bf16_allreduce": {"gradient_compression": "bf16"},
    "powersgd": {
        "gradient_compression": "powersgd",
        "powersgd_configs": {"rank": 2, "start_step": 23, "min_compression_bytes": 0},
    },
    "dgc": {"dgc": True, "dgc_configs": _DGC_RAMP},
    "localsgd": {"localsgd": True, "localsgd_configs": {"k_steps": 4, "begin_step": 23}},
    "amp_bf16": {"amp": True, "amp_configs": {"dtype": "bfloat16"}},
    "sharding": {"sharding": True, "sharding_configs": {"stage": 2}},
}
EXACT = ("baseline", "sharding")
"""Methods whose parameters must equal single-process training on the same global batches."""


def strategy_for(method: str) -> Any:
    """A fresh ``lb.Strategy`` for ``method`` (a key of ``METHODS``)."""
    import longboat as lb

    if method not in METHODS:
        raise ValueError(f"unknown demo method {method!r}; choose one of {', '.join(METHODS)}")
    return lb.Strategy(**METHODS[method])

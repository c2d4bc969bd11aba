"""The straggler effect: a synchronous step waits for the slowest of N ranks.

If each rank's compute time in a step is ``T (1 + jitter Z)`` with ``Z`` independent standard
normal variables (``jitter``: the coefficient of variation of one rank's step time), the
allreduce that ends the step cannot finish before the slowest rank's last gradient, so the step
is longer than one rank's by ``jitter * T * E[max of N standard normals]`` on average. That
expected maximum is 0 for one rank, 0.56 for 2, 1.42 for 8, 2.83 for 256 and grows like
``sqrt(2 ln N)``. Over ``k`` micro-steps (gradient merge) the ranks' times add up and only
their sum must agree, so the relative spread shrinks by ``sqrt(k)``.

Devices of one model also differ persistently (manufacturing and power management: the same
SKU sustains different clocks, see docs/sim.md). With each device's speed ``1 + spread Z`` for
the whole run, a synchronous job runs at its slowest device's pace: every micro-step waits
``spread * T * E[max of N standard normals]``, which does not average out over micro-steps.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

_GRID = np.linspace(-12.0, 12.0, 24001)
_PDF = np.exp(-(_GRID**2) / 2) / math.sqrt(2 * math.pi)
_CDF = 0.5 * (1 + np.vectorize(math.erf)(_GRID / math.sqrt(2)))


@lru_cache(maxsize=4096)
def expected_max(n: int) -> float:
    """E[max of ``n`` independent standard normal variables] (0 for ``n`` = 1)."""
    if n < 1:
        raise ValueError(f"expected_max needs n >= 1, got {n}")
    if n == 1:
        return 0.0
    density = n * _PDF * _CDF ** (n - 1)
    return float(np.trapezoid(_GRID * density, _GRID))


def straggler_seconds(compute_s: float, jitter: float, ranks: int, micro_steps: int = 1) -> float:
    """Expected extra seconds per micro-step waiting for the slowest of ``ranks`` ranks whose
    per-micro-step compute is ``compute_s`` with coefficient of variation ``jitter``."""
    if ranks <= 1 or jitter <= 0:
        return 0.0
    return jitter * compute_s * expected_max(ranks) / math.sqrt(max(micro_steps, 1))


def spread_seconds(compute_s: float, spread: float, ranks: int) -> float:
    """Expected extra seconds per micro-step waiting for the slowest of ``ranks`` devices whose
    persistent speeds have coefficient of variation ``spread``."""
    if ranks <= 1 or spread <= 0:
        return 0.0
    return spread * compute_s * expected_max(ranks)

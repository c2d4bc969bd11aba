"""``is_extended``: whether an optimizer was already passed to ``lb.distribute``.

Kept under this name for `longboat.ownership`; it is `longboat.optim.staged.is_distributed`
(optimizers are no longer extended in place: `longboat.optim.staged.StagedOptimizer` wraps them).
"""

from __future__ import annotations

from longboat.optim.staged import is_distributed as is_extended

__all__ = ["is_extended"]

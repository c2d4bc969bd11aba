"""Compiled autograd is refused: the one check the reducer runs on every backward, apart
from `longboat.collective.compile` so that the reducer does not import the compile path."""

from __future__ import annotations

import torch

HOW = (
    "compile the model lb.distribute returns with model.compile(...) or lb.compile(model, ...) "
    "(the arguments of torch.compile), which cuts the compiled graph at longboat's bucket "
    "boundaries (docs/compile.md)"
)
"""How to compile a longboat model and keep its overlap (named in every compile message)."""


def refuse_compiled_autograd() -> None:
    """Raise if compiled autograd is on: it traces the whole backward, the reducer's gradient
    hooks included, into one graph, so buckets could not launch during backward."""
    from torch._dynamo import compiled_autograd

    if (
        torch._dynamo.config.compiled_autograd
        or compiled_autograd.compiled_autograd_enabled
        or compiled_autograd.in_compiled_autograd_region
    ):
        raise RuntimeError(
            "compiled autograd (torch._dynamo.config.compiled_autograd or "
            "torch._dynamo.compiled_autograd.enable) is not supported with longboat: it "
            "traces the whole backward, longboat's gradient hooks included, into one graph. "
            f"Turn it off; to compile the model with overlap, {HOW}."
        )

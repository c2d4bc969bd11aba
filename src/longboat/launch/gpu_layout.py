"""Refuse more NCCL ranks on a node than it has GPUs, before any rank starts.

With CUDA, ranks default to NCCL and each takes the GPU of its local rank
(`longboat.cluster.init`); two ranks on one GPU fail deep inside NCCL ("Duplicate GPU
detected"), a rank past the last GPU with "invalid device ordinal". The launcher knows the
backend only when nothing overrides it in code, so it checks when CUDA is available here and
LONGBOAT_BACKEND is unset or nccl, or when LONGBOAT_BACKEND is nccl.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from longboat.cluster.env import variable


def gpu_layout_problem(ranks: int, env: Mapping[str, str] | None = None) -> str | None:
    """Why ``ranks`` NCCL ranks cannot run on this node's visible GPUs (None when they can, or
    when the backend will not be NCCL): one line naming the GPUs and both fixes."""
    env = os.environ if env is None else env
    backend = variable("LONGBOAT_BACKEND", env)
    if backend not in (None, "nccl"):
        return None
    import torch

    if backend is None and not torch.cuda.is_available():
        return None  # the ranks choose gloo
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if ranks <= count:
        return None
    if count == 0:  # LONGBOAT_BACKEND=nccl without a GPU
        return (
            f"LONGBOAT_BACKEND=nccl but torch sees no GPU here{_visible(env)}; set "
            "LONGBOAT_BACKEND=gloo, or run on a machine with GPUs"
        )
    why = "LONGBOAT_BACKEND=nccl" if backend else "NCCL (the default with CUDA)"
    return (
        f"{ranks} ranks on this node but {_seen(count, env)}, and with {why} every rank needs "
        f"a GPU of its own: start one rank per GPU (--nproc-per-node {count}), or set "
        "LONGBOAT_BACKEND=gloo to let ranks share a GPU"
    )


def _seen(count: int, env: Mapping[str, str]) -> str:
    """``torch sees 1 GPU (0: NVIDIA H100)``, names where torch can tell them."""
    names = []
    try:
        import torch

        names = [f"{i}: {torch.cuda.get_device_name(i)}" for i in range(count)]
    except Exception:  # a name is a courtesy; the count is what matters
        names = []
    listed = f" ({', '.join(names)})" if names else ""
    return f"torch sees {count} GPU{'s' if count != 1 else ''}{listed}{_visible(env)}"


def _visible(env: Mapping[str, str]) -> str:
    visible = env.get("CUDA_VISIBLE_DEVICES")
    return f" with CUDA_VISIBLE_DEVICES={visible}" if visible is not None else ""

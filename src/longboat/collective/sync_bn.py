"""Synchronised batch normalisation that runs on CPU (Gloo) and GPU (NCCL).

In training, every rank normalises with the mean and variance of the *global* batch (all ranks'
samples together). Forward: one allreduce of ``[sum, sum of squares, count]`` per channel.
Backward: one allreduce of ``[sum(dy), sum(dy * x_hat)]``. Per-channel sums are accumulated in
float64, so ``E[x^2] - E[x]^2`` keeps float32 precision; bf16/fp16 inputs are normalised in float32.

Gradient convention: rank ``r`` backpropagates its own loss ``L_r``. The input gradient on each
rank is that of ``sum_r L_r`` (so upstream parameters get their share of every rank's loss), and
the weight/bias gradients are the *local* sums ``sum_{i on r} dy_i * x_hat_i`` / ``sum dy_i``.
After the data-parallel reducer averages over ``W`` ranks, every parameter's gradient equals
single-process BatchNorm's for the loss ``(1/W) sum_r L_r`` — the global-batch mean loss when
each ``L_r`` is a mean over equally sized local batches.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.function import once_differentiable
from torch.nn.modules.batchnorm import _BatchNorm

from longboat.trace.stall import waiting

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm"]

_ACC = torch.float64  # accumulation dtype of the per-channel sums (see module docstring)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float32 for half/bfloat16 (and float32) inputs; float64 stays float64."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _channel_shape(x: torch.Tensor) -> tuple[int, ...]:
    """Shape that broadcasts a per-channel vector against ``x`` of shape (N, C, *)."""
    return (1, x.shape[1]) + (1,) * (x.dim() - 2)


def _reduce_dims(x: torch.Tensor) -> list[int]:
    return [0, *range(2, x.dim())]


class _Ctx(Protocol):
    """What the forward of `_SyncBatchNormFn` keeps for its backward (autograd's ctx)."""

    count: torch.Tensor | float
    group: dist.ProcessGroup | None
    names: tuple[str, str]
    saved_tensors: tuple[torch.Tensor, ...]
    needs_input_grad: tuple[bool, ...]

    def save_for_backward(self, *tensors: torch.Tensor | None) -> None: ...


class _SyncBatchNormFn(torch.autograd.Function):
    """Global-batch normalisation; both passes do exactly one allreduce on ``group``."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: _Ctx,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        running_mean: torch.Tensor | None,
        running_var: torch.Tensor | None,
        eps: float,
        momentum: float,
        group: dist.ProcessGroup | None,
        names: tuple[str, str] = ("sync BN statistics", "sync BN gradient statistics"),
    ) -> torch.Tensor:
        channels, dims, shape = x.shape[1], _reduce_dims(x), _channel_shape(x)
        local_count = x.numel() // channels if channels else 0
        stats = torch.cat(
            [
                x.sum(dims, dtype=_ACC),
                torch.linalg.vector_norm(x, 2, dims, dtype=_ACC).square(),
                torch.full((1,), float(local_count), dtype=_ACC, device=x.device),
            ]
        )
        with waiting(names[0], group):  # the stall inspector's name for this wait
            dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)
        # The global count stays on the device (no host stall per layer); it is read only
        # when this rank's own count cannot rule out a degenerate batch.
        count: torch.Tensor | float = stats[-1]
        if local_count <= 1:
            count = float(stats[-1])
            if count == 1:
                raise ValueError(
                    f"SyncBatchNorm: expected more than 1 value per channel across all ranks "
                    f"when training, got 1 (local input shape {tuple(x.shape)}); use a larger "
                    "batch or call .eval()"
                )
        mean = stats[:channels] / count
        var = (stats[channels : 2 * channels] / count - mean.square()).clamp_min_(0.0)
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None and running_var is not None and (local_count > 1 or count):
            unbiased = var * (count / (count - 1))
            running_mean.mul_(1.0 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
            running_var.mul_(1.0 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)

        cd = _compute_dtype(x)
        mean_c, invstd_c = mean.to(cd), invstd.to(cd)
        scale = invstd_c if weight is None else invstd_c * weight.to(cd)
        y = (x.to(cd) - mean_c.view(shape)) * scale.view(shape)
        if bias is not None:
            y = y + bias.to(cd).view(shape)
        ctx.save_for_backward(x, weight, mean_c, invstd_c)
        ctx.count, ctx.group, ctx.names = count, group, names
        return y.to(x.dtype)

    @staticmethod
    @once_differentiable
    def backward(  # type: ignore[override]
        ctx: _Ctx, grad_out: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        x, weight, mean, invstd = ctx.saved_tensors
        channels, dims, shape = x.shape[1], _reduce_dims(x), _channel_shape(x)
        cd = mean.dtype
        dy = grad_out.to(cd)
        x_hat = (x.to(cd) - mean.view(shape)) * invstd.view(shape)
        sum_dy = dy.sum(dims, dtype=_ACC)
        sum_dy_xhat = (dy * x_hat).sum(dims, dtype=_ACC)
        needs = ctx.needs_input_grad

        grad_x = None
        if needs[0]:
            sums = torch.cat([sum_dy, sum_dy_xhat])
            with waiting(ctx.names[1], ctx.group):
                dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=ctx.group)
            mean_dy = (sums[:channels] / ctx.count).to(cd)
            mean_dy_xhat = (sums[channels:] / ctx.count).to(cd)
            scale = invstd if weight is None else invstd * weight.to(cd)
            grad_x = (dy - mean_dy.view(shape) - x_hat * mean_dy_xhat.view(shape)) * scale.view(
                shape
            )
            grad_x = grad_x.to(x.dtype)
        grad_w = sum_dy_xhat.to(weight.dtype) if weight is not None and needs[1] else None
        grad_b = sum_dy.to(weight.dtype) if weight is not None and needs[2] else None
        return grad_x, grad_w, grad_b, None, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """BatchNorm over the global batch of all ranks in ``process_group`` (default: WORLD).

    Accepts input of shape (N, C) or (N, C, *) like BatchNorm1d/2d/3d; N may differ per rank,
    including 0. Synchronises only in training mode; eval mode uses the running statistics and
    never communicates. With no process group initialised, or a group of size 1, it is exactly
    ``nn.BatchNorm``. Every rank of the group must run each forward and backward of this layer.
    """

    #: what the stall inspector calls this layer's forward and backward allreduce (``lb.distribute``
    #: names them after the layer: "sync BN statistics of bn1")
    stall_names = ("sync BN statistics", "sync BN gradient statistics")

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype
        )
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(
                f"SyncBatchNorm: expected input of shape (N, C) or (N, C, *), got {input.dim()}D "
                f"input of shape {tuple(input.shape)}"
            )
        if input.shape[1] != self.num_features:
            raise ValueError(
                f"SyncBatchNorm: input has {input.shape[1]} channels (dim 1) but the layer was "
                f"built for num_features={self.num_features}"
            )

    def _group_size(self) -> int:
        if not (dist.is_available() and dist.is_initialized()):
            return 1
        size = dist.get_world_size(self.process_group)
        if size < 1:
            raise ValueError(
                f"SyncBatchNorm: rank {dist.get_rank()} is not a member of this layer's "
                f"process_group; pass a group containing every rank that runs the layer"
            )
        return size

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalise ``input``; in training with more than one rank, over the global batch."""
        self._check_input_dim(input)
        if not self.training or self._group_size() == 1:
            return super().forward(input)  # plain BatchNorm: eval, or nobody to sync with

        factor = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = (
                1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
            )
        running = self.track_running_stats
        return _SyncBatchNormFn.apply(
            input,
            self.weight,
            self.bias,
            self.running_mean if running else None,
            self.running_var if running else None,
            self.eps,
            factor,
            self.process_group,
            self.stall_names,
        )


_CONVERTIBLE = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def convert_sync_batchnorm(
    module: nn.Module, process_group: dist.ProcessGroup | None = None
) -> nn.Module:
    """Replace every BatchNorm1d/2d/3d and torch SyncBatchNorm in ``module`` with SyncBatchNorm.

    The new layers reuse the old parameter and buffer tensors (so values, ``requires_grad`` and
    an optimizer built earlier all carry over) and copy eps, momentum, affine,
    track_running_stats and the training flag. Returns the converted module (a new object when
    ``module`` itself is a BatchNorm); existing longboat SyncBatchNorms are left as they are.
    """
    if isinstance(module, _CONVERTIBLE) and not isinstance(module, SyncBatchNorm):
        new = SyncBatchNorm(
            module.num_features,
            eps=module.eps,
            momentum=module.momentum,
            affine=module.affine,
            track_running_stats=module.track_running_stats,
            process_group=process_group,
        )
        if module.affine:
            new.weight, new.bias = module.weight, module.bias
        new.running_mean = module.running_mean
        new.running_var = module.running_var
        new.num_batches_tracked = module.num_batches_tracked
        new.train(module.training)
        if hasattr(module, "qconfig"):
            new.qconfig = module.qconfig
        out: nn.Module = new
    else:
        out = module
    for name, child in module.named_children():
        out.add_module(name, convert_sync_batchnorm(child, process_group))
    return out

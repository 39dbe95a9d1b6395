"""SyncBatchNorm: batch normalisation over the global batch, on any backend (gloo/CPU too).

Batch normalisation (arXiv 1502.03167, algorithm 1) normalises with the mean and
variance of the mini-batch. Under data parallelism each rank sees only its slice,
so plain ``BatchNorm`` normalises with per-rank statistics: a different function
from the one a single process computes on the whole batch, noisier for small
per-rank batches, and its running statistics drift apart across replicas.
``torch.nn.SyncBatchNorm`` fixes this on GPUs only (it raises for CPU tensors).
This module is its drop-in for every backend, with the same rules as torch's:
statistics are synchronised in training mode only, a missing process group or a
group of one falls back to local batch norm, eval mode with running statistics
communicates nothing (a rank may evaluate alone), and every rank of the group
must run each training forward and backward (a rank with an empty batch still
does; its zero-sized slice contributes nothing).

Exactness, so a converted model computes what one process computes on the whole
batch, however unevenly the batch is split (a rank may hold 0 samples):

* Forward: each rank computes its count, mean and sum of squared deviations
  (two passes over its own data) and one all-gather of ``1 + 2C`` float64 values
  brings every rank's triple; they are combined in rank order with the pairwise
  update of Chan, Golub and LeVeque ("Algorithms for computing the sample
  variance", 1983), which stays stable where sum-and-sum-of-squares cancels, and
  gives every rank bitwise the same statistics.
* Running statistics: updated as ``BatchNorm`` does on the whole batch: the
  unbiased variance with the *global* count, ``momentum``, ``num_batches_tracked``
  and the cumulative average for ``momentum=None``.
* Backward: the input gradient of the global-batch normalisation needs the sums
  of ``dy`` and ``dy * xhat`` over the global batch (the chain rule of the
  paper's section 3, with the batch being the global one): one
  all-reduce of ``2C`` values, skipped (on every rank alike) when the input needs
  no gradient, as torch's SyncBatchNorm does. Weight and bias gradients are this
  rank's own; the data-parallel wrapper reduces them like any parameter's.

Measured in ``tests/engine/test_sync_batchnorm.py`` (float64, 3 ranks, uneven
batches and a rank with none, 1d and 2d): outputs, input and parameter gradients
and running statistics at most 3.6e-15 from one ``BatchNorm`` on the whole batch
(the test's bound is 1e-12); a model trained 3 steps inside ``DataParallel`` with
``num_items`` sits 2.2e-16 from one process with plain ``BatchNorm``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..transport import comm


def _stat_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _combine(gathered: torch.Tensor, channels: int):
    """Global (count, mean, M2) from every rank's row of (count, mean[C], M2[C]), in rank order."""
    rows = gathered.view(-1, 1 + 2 * channels)
    n = rows[0, 0].clone()
    mean, m2 = rows[0, 1:1 + channels].clone(), rows[0, 1 + channels:].clone()
    for row in rows[1:]:
        nb = row[0]
        if nb == 0:
            continue
        total = n + nb
        delta = row[1:1 + channels] - mean
        mean += delta * (nb / total)
        m2 += row[1 + channels:] + delta * delta * (n * nb / total)
        n = total
    return float(n), mean, m2


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, factor, group):
        channels = x.shape[1]
        dims = [0] + list(range(2, x.dim()))
        shape = [1, channels] + [1] * (x.dim() - 2)
        acc = _stat_dtype(x)
        xa = x.to(acc)
        count = x.numel() // channels if channels else 0
        if count:
            mean_local = xa.mean(dims)
            m2_local = (xa - mean_local.view(shape)).pow(2).sum(dims)
        else:
            mean_local = m2_local = torch.zeros(channels, dtype=acc, device=x.device)
        mine = torch.cat([torch.tensor([float(count)], dtype=torch.float64, device=x.device),
                          mean_local.double(), m2_local.double()])
        world = dist.get_world_size(group)
        everyone = torch.empty(world * mine.numel(), dtype=torch.float64, device=x.device)
        comm.all_gather_single(everyone, mine, group=group, tag="syncbn-stats")
        n, mean, m2 = _combine(everyone, channels)
        if n <= 1:
            raise ValueError(
                f"SyncBatchNorm: expected more than 1 value per channel when training, got "
                f"{int(n)} over all ranks of the group (this rank's input: {tuple(x.shape)})")
        invstd = (m2 / n + eps).rsqrt()
        if running_mean is not None:
            with torch.no_grad():
                running_mean.mul_(1 - factor).add_(mean.to(running_mean.dtype), alpha=factor)
                unbiased = (m2 / (n - 1)).to(running_var.dtype)
                running_var.mul_(1 - factor).add_(unbiased, alpha=factor)
        xhat = (xa - mean.to(acc).view(shape)) * invstd.to(acc).view(shape)
        y = xhat
        if weight is not None:
            y = y * weight.to(acc).view(shape)
        if bias is not None:
            y = y + bias.to(acc).view(shape)
        ctx.save_for_backward(xhat, weight, invstd.to(acc))
        ctx.count, ctx.group, ctx.has_bias = n, group, bias is not None
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        xhat, weight, invstd = ctx.saved_tensors
        channels = xhat.shape[1]
        dims = [0] + list(range(2, xhat.dim()))
        shape = [1, channels] + [1] * (xhat.dim() - 2)
        dya = dy.to(xhat.dtype)
        sum_dy = dya.sum(dims)
        sum_dy_xhat = (dya * xhat).sum(dims)
        dx = None
        if ctx.needs_input_grad[0]:
            sums = torch.cat([sum_dy, sum_dy_xhat]).double()
            comm.all_reduce(sums, group=ctx.group, tag="syncbn-grad")
            mean_dy = (sums[:channels] / ctx.count).to(xhat.dtype)
            mean_dy_xhat = (sums[channels:] / ctx.count).to(xhat.dtype)
            scale = invstd if weight is None else invstd * weight.to(xhat.dtype)
            dx = ((dya - mean_dy.view(shape) - xhat * mean_dy_xhat.view(shape))
                  * scale.view(shape)).to(dy.dtype)
        dw = db = None
        if weight is not None and ctx.needs_input_grad[1]:
            dw = sum_dy_xhat.to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = sum_dy.to(dy.dtype)
        return dx, dw, db, None, None, None, None, None


class SyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """``BatchNorm1d/2d/3d`` whose training statistics are those of the whole global batch.

    Same arguments as ``torch.nn.SyncBatchNorm`` (``group`` is its ``process_group``,
    either name accepted; ``None`` means the world). Input: ``(N, C, *)`` with at
    least 2 dimensions.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True, group=None,
                 device=None, dtype=None, *, bias: bool = True, process_group=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         device=device, dtype=dtype, bias=bias)
        self.group = group if process_group is None else process_group

    @classmethod
    def convert_sync_batchnorm(cls, module: nn.Module, process_group=None) -> nn.Module:
        """torch's spelling of :func:`convert_sync_batchnorm`."""
        return convert_sync_batchnorm(module, process_group)

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError("SyncBatchNorm expects an input of at least 2 dimensions (N, C, "
                             f"...), got {input.dim()}D of shape {tuple(input.shape)}")
        if input.shape[1] != self.num_features:
            raise ValueError(f"SyncBatchNorm({self.num_features}) got {input.shape[1]} channels "
                             f"(input of shape {tuple(input.shape)})")

    def _synchronised(self) -> bool:
        return (self.training and dist.is_available() and dist.is_initialized()
                and dist.get_world_size(self.group) > 1)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                factor = 1.0 / float(self.num_batches_tracked)
        tracked = not self.training or self.track_running_stats
        running_mean = self.running_mean if tracked else None
        running_var = self.running_var if tracked else None
        if not self._synchronised():
            bn_training = self.training or (self.running_mean is None and self.running_var is None)
            return F.batch_norm(input, running_mean, running_var, self.weight, self.bias,
                                bn_training, factor, self.eps)
        return _SyncBatchNormFunction.apply(input, self.weight, self.bias, running_mean,
                                            running_var, self.eps, factor, self.group)


def convert_sync_batchnorm(module: nn.Module, group=None) -> nn.Module:
    """Replace every BatchNorm (1d/2d/3d) in ``module`` by :class:`SyncBatchNorm`.

    Parameters and buffers are the same tensors (an optimizer built before still
    holds them), and the training flag is kept. Returns the converted module,
    which is a new object when ``module`` itself is a BatchNorm.
    """
    out = module
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module,
                                                                              SyncBatchNorm):
        out = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, group, bias=module.bias is not None)
        if module.affine:
            out.weight = module.weight
            out.bias = module.bias
        out.running_mean = module.running_mean
        out.running_var = module.running_var
        out.num_batches_tracked = module.num_batches_tracked
        out.training = module.training
        if hasattr(module, "qconfig"):
            out.qconfig = module.qconfig
    for name, child in module.named_children():
        out.add_module(name, convert_sync_batchnorm(child, group))
    return out

"""memory_report(): the bytes this rank holds right now, by what they are for.

Model state is what the ZeRO paper (arXiv 1910.02054, section 3.1) partitions:
working parameters, gradients, fp32 master weights and optimizer moments. Padding
(to make equal shards) and communication buffers are listed separately so a
report can be compared with ZeRO's formulas (:func:`model_state_bytes` below, arXiv
1910.02054 section 5):
with bf16 parameters and AdamW, model state is 16P for DDP, 4P + 12P/N for stage 1,
2P + 14P/N for stage 2 and 16P/N for stage 3.

Counted from the tensors themselves (storage actually allocated), not from a
model of what should be there, so a leak or a buffer that was not released shows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

STAGE_NAMES = {0: "ddp", 1: "zero1", 2: "zero2", 3: "zero3"}


def model_state_bytes(num_params: int, world: int, stage: int, k: int = 12) -> float:
    """ZeRO's model-state bytes per rank (arXiv 1910.02054, sections 3.1 and 5: 2-byte
    params and grads, k bytes of optimizer state per parameter; k = 12 for Adam with
    fp32 master weights).

    stage 0 (plain DP): (4 + k)P; 1: 4P + kP/N; 2: 2P + (2 + k)P/N; 3: (4 + k)P/N.
    """
    p, n = float(num_params), float(world)
    if stage == 0:
        return (4 + k) * p
    if stage == 1:
        return 4 * p + k * p / n
    if stage == 2:
        return 2 * p + (2 + k) * p / n
    if stage == 3:
        return (4 + k) * p / n
    raise ValueError(f"stage must be 0..3, got {stage}")


@dataclass(frozen=True)
class MemoryReport:
    """Bytes held by this rank. ``model_state`` excludes padding, comm buffers and
    residuals.

    Two kinds of bytes exist only in some runs, and a report says them by name rather
    than under another's: ``outer_copy``, the global model a DiLoCo worker keeps
    beside its replica between syncs (not fp32 master weights: it has the model's own
    dtype, and nothing computes in a lower one), and ``residuals``, a compressor's
    error-feedback state (gradient-sized for int8 and PowerSGD, on every rank).
    ``strategy`` names the run's method where the stage does not (``diloco``).
    """

    stage: int
    world: int
    num_params: int
    params: int
    grads: int
    master_params: int
    optimizer_state: int
    comm_buffers: int
    padding: int
    outer_copy: int = 0
    residuals: int = 0
    strategy: str = ""

    @property
    def model_state(self) -> int:
        return (self.params + self.grads + self.master_params + self.outer_copy
                + self.optimizer_state)

    def formula(self, k: int = 12) -> float:
        """ZeRO's formula for this stage (bf16 params/grads, k bytes of optimizer state)."""
        return model_state_bytes(self.num_params, self.world, self.stage, k)

    def render(self) -> str:
        mib = 2**20
        rows = [("parameters", self.params), ("gradients", self.grads)]
        if self.outer_copy:
            rows.append(("outer copy (global model)", self.outer_copy))
        else:
            rows.append(("fp32 master weights", self.master_params))
        rows += [("optimizer state", self.optimizer_state), ("model state", self.model_state),
                 ("communication buffers", self.comm_buffers)]
        if self.residuals:
            rows.append(("error-feedback residual", self.residuals))
        rows.append(("padding", self.padding))
        name = self.strategy or STAGE_NAMES.get(self.stage, self.stage)
        head = f"memory ({name}, per rank of {self.world}, P = {self.num_params:,})"
        return "\n".join([head] + [f"  {k:<25} {v / mib:10.3f} MiB" for k, v in rows])


def held(t: torch.Tensor | None) -> int:
    """Bytes of ``t``'s elements if its storage is allocated (0 for freed storage)."""
    if t is None or t.untyped_storage().nbytes() == 0:
        return 0
    return t.numel() * t.element_size()


def split_real(t: torch.Tensor | None, real: int) -> tuple[int, int]:
    """(bytes of the first ``real`` elements, bytes of the rest) if ``t`` is held."""
    if not held(t):
        return 0, 0
    real = min(real, t.numel())
    return real * t.element_size(), (t.numel() - real) * t.element_size()


def optimizer_bytes(optimizer, param: torch.Tensor, real: int) -> tuple[int, int]:
    """(state bytes, padding bytes) of ``optimizer``'s state for the flat ``param``."""
    state, pad = 0, 0
    for v in optimizer.state.get(param, {}).values():
        if isinstance(v, torch.Tensor):
            if v.numel() == param.numel() and v.numel() > 1:
                a, b = split_real(v, real)
                state, pad = state + a, pad + b
            else:
                state += held(v)
    return state, pad


def pieces_bytes(optimizer, view) -> int:
    """Optimizer state held for the pieces of one shard (``shard_view.ShardView``)."""
    return sum(optimizer_bytes(optimizer, t, t.numel())[0] for t in view.tensors)


def report_data_parallel(dp, optimizer) -> MemoryReport:
    """Plain DataParallel (stage 0): everything replicated."""
    params = sum(held(p) for p in dp.module.parameters())
    grads = sum(held(b.buffer) for b in dp.buckets)
    opt_state = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            opt_state += optimizer_bytes(optimizer, p, p.numel())[0]
    num = sum(p.numel() for p in dp.module.parameters() if p.requires_grad)
    return MemoryReport(0, dp.world_size, num, params, grads, 0, opt_state, 0, 0)

"""memory_report(): the bytes this rank holds right now, by what they are for.

Model state is what the ZeRO paper (arXiv 1910.02054, section 3.1) partitions:
working parameters, gradients, fp32 master weights and optimizer moments. Padding
(to make equal shards) and communication buffers are listed separately so a
report can be compared with ZeRO's formulas (``sharding.model_state_bytes``, arXiv
1910.02054 section 5):
with bf16 parameters and AdamW, model state is 16P for DDP, 4P + 12P/N for stage 1,
2P + 14P/N for stage 2 and 16P/N for stage 3.

Counted from the tensors themselves (storage actually allocated), not from a
model of what should be there, so a leak or a buffer that was not released shows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sharded.shards import STAGE_NAMES, model_state_bytes


@dataclass(frozen=True)
class MemoryReport:
    """Bytes held by this rank. ``model_state`` excludes padding and comm buffers."""

    stage: int
    world: int
    num_params: int
    params: int
    grads: int
    master_params: int
    optimizer_state: int
    comm_buffers: int
    padding: int

    @property
    def model_state(self) -> int:
        return self.params + self.grads + self.master_params + self.optimizer_state

    def formula(self, k: int = 12) -> float:
        """ZeRO's formula for this stage (bf16 params/grads, k bytes of optimizer state)."""
        return model_state_bytes(self.num_params, self.world, self.stage, k)

    def render(self) -> str:
        mib = 2**20
        rows = [("parameters", self.params), ("gradients", self.grads),
                ("fp32 master weights", self.master_params),
                ("optimizer state", self.optimizer_state), ("model state", self.model_state),
                ("communication buffers", self.comm_buffers), ("padding", self.padding)]
        head = (f"memory ({STAGE_NAMES.get(self.stage, self.stage)}, per rank of {self.world}, "
                f"P = {self.num_params:,})")
        return "\n".join([head] + [f"  {k:<22} {v / mib:10.3f} MiB" for k, v in rows])


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


def report_zero(zopt) -> MemoryReport:
    params = grads = master = opt_state = comm_b = pad = 0
    num = 0
    for s in zopt.shards:
        lay = s.layout
        num += lay.numel
        item = s.flat.element_size()
        params += held(s.flat) and lay.numel * item
        pad += held(s.flat) and lay.padding * item
        buf = s.bucket.buffer
        if held(buf):
            grads += lay.numel * buf.element_size()
            pad += lay.padding * buf.element_size()
        real = lay.real_numel(zopt.rank)
        if zopt.stage == 2:
            a, b = split_real(s.grad, real)
            grads, pad = grads + a, pad + b
        if s.master.untyped_storage().data_ptr() != s.flat.untyped_storage().data_ptr():
            a, b = split_real(s.master, real)  # a separate (fp32) master copy
            master, pad = master + a, pad + b
        opt_state += pieces_bytes(zopt.optimizer, s.view)
        if s.src is not None and s.src is not buf:
            comm_b += held(s.src)
    return MemoryReport(zopt.stage, zopt.world, num, params, grads, master, opt_state,
                        comm_b, pad)


def report_fsdp(model, optimizer=None) -> MemoryReport:
    """Stage 3: gathered buffers count as parameters while they are held (transient)."""
    params = grads = master = opt_state = pad = 0
    num = 0
    for u in model.units:
        lay = u.layout
        num += lay.numel
        real = lay.real_numel(model.rank)
        a, b = split_real(u.full, lay.numel)
        params, pad = params + a, pad + b
        a, b = split_real(u.shard, real)
        master, pad = master + a, pad + b
        a, b = split_real(u.grad, real)
        grads, pad = grads + a, pad + b
        a, b = split_real(u.acc, lay.numel)
        grads, pad = grads + a, pad + b
        if optimizer is not None:
            opt_state += pieces_bytes(optimizer, u.view)
    return MemoryReport(3, model.world, num, params, grads, master, opt_state, 0, pad)


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

"""Memory reports of the sharded strategies: what one rank holds of ZeRO's model state.

Counted from the shards' tensors (storage actually allocated), in the same
:class:`~gradsync.engine.replicated.memory_report.MemoryReport` as plain data
parallelism, so a report can be set against ZeRO's formulas (arXiv 1910.02054,
section 5): per rank, padding apart, 4P + 12P/N for stage 1, 2P + 14P/N for stage
2 and 16P/N for stage 3 with bf16 parameters and AdamW.
"""

from __future__ import annotations

from ..replicated.memory_report import MemoryReport, held, pieces_bytes, split_real


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
        own = s.grad is not None and (  # stage 1 with fp16: an fp32 slice of its own
            s.grad.untyped_storage().data_ptr() != buf.untyped_storage().data_ptr())
        if zopt.stage == 2 or own:
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

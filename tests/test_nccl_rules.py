"""The strict process group (``gradsync/nccl_rules.py``) refuses what NCCL refuses.

Each rule is planted once on 2 real processes under ``GRADSYNC_NCCL_RULES`` and must
be refused with its one line on the rank that breaks it; what NCCL accepts runs and
moves the right values. The core multi-rank tests run under the rules in
``tests/test_core_under_nccl_rules.py``.
"""

import threading

import pytest
import torch
import torch.distributed as dist

import gradsync as gs
from gradsync.nccl_rules import NcclRuleError

pytestmark = pytest.mark.slow


def _try(fn) -> str | None:
    try:
        fn()
        return None
    except NcclRuleError as e:
        return str(e)


def _rules_job() -> dict:
    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    out = {}
    # what NCCL accepts: one round as one batch_isend_irecv, receives first
    got = torch.zeros(3)
    works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, got, peer),
                                    dist.P2POp(dist.isend, torch.full((3,), rank + 1.0), peer)])
    for w in works:
        w.wait()
    out["grouped"] = got.tolist()

    def ungrouped():  # both ranks receive first, then send: NCCL waits for ever
        a = dist.irecv(torch.zeros(3), peer)
        b = dist.isend(torch.ones(3), peer)
        a.wait()
        b.wait()
    out["ungrouped"] = _try(ungrouped)
    dist.barrier()  # the refused rank left its receive posted: a fresh round for both
    out["noncontiguous"] = _try(lambda: dist.all_reduce(torch.zeros(4, 4).t()))

    def two_batches():  # receives in one group call, sends in the next: the same deadlock
        recv = dist.batch_isend_irecv([dist.P2POp(dist.irecv, torch.zeros(2), peer)])
        send = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(2), peer)])
        for w in recv + send:
            w.wait()
    out["two_batches"] = _try(two_batches)
    dist.barrier()

    def two_threads():  # an async all-reduce in flight, then another thread issues
        started = threading.Event()
        errors = []
        work = dist.all_reduce(torch.ones(1 << 16), async_op=True) if rank == 0 else None

        def other():
            started.set()
            try:
                dist.all_reduce(torch.ones(1))
            except NcclRuleError as e:
                errors.append(str(e))
        if rank == 0:
            t = threading.Thread(target=other)
            t.start()
            t.join(timeout=30)
            work.wait()
            dist.all_reduce(torch.ones(1))  # the thread was refused: pair rank 1's
        else:
            dist.all_reduce(torch.ones(1 << 16))
            dist.all_reduce(torch.ones(1))
        if errors:
            raise NcclRuleError(errors[0])
    out["two_threads"] = _try(two_threads)
    return out


def test_each_rule_is_refused_where_it_is_broken(monkeypatch):
    monkeypatch.setenv("GRADSYNC_NCCL_RULES", "1")
    res = gs.spawn(_rules_job, 2, timeout_s=60)
    for rank, r in enumerate(res):
        assert r["grouped"] == [2.0 - rank] * 3  # the peer's rank + 1
        assert "batch_isend_irecv" in r["ungrouped"] and "in flight" in r["ungrouped"], r
        assert "non-contiguous" in r["noncontiguous"], r
        assert "batch_isend_irecv" in r["two_batches"], r
    assert "in flight on it" in res[0]["two_threads"], res[0]
    assert res[1]["two_threads"] is None


def _device_job() -> dict:
    """The emulated accelerator: host tensors handed to its group are refused."""
    out = {"cpu": _try(lambda: dist.all_reduce(torch.ones(2))),
           "object": _try(lambda: dist.all_gather_object([None, None],
                                                        {"t": torch.ones(2, device="meta")}))}
    t = torch.ones(2, device="meta")
    dist.all_reduce(t)  # shape-only: fine
    out["meta"] = str(t.device)
    mismatch = torch.ones(3 if dist.get_rank() else 2, device="meta")
    out["mismatch"] = _try(lambda: dist.all_reduce(mismatch))
    return out


def test_the_emulated_accelerator_refuses_host_tensors(monkeypatch):
    monkeypatch.setenv("GRADSYNC_NCCL_RULES", "meta")
    for r in gs.spawn(_device_job, 2, timeout_s=60):
        assert "a cpu tensor" in r["cpu"] and "device is meta" in r["cpu"], r
        assert "unpickle" in r["object"], r
        assert r["meta"] == "meta"
        assert "ranks issued different collectives" in r["mismatch"], r


def _sharded_save_job(path: str) -> list[str]:
    from gradsync.engine.sharded.checkpoint import save_sharded
    from tests.engine.sharded_models import Net

    dp = gs.DataParallel(Net(), bucket_cap_mb=0.0005)
    opt = gs.ZeroOptimizer(dp, torch.optim.AdamW, stage=2, lr=1e-2)
    pg = dist.distributed_c10d._get_default_group()
    before = len(pg.ops)
    save_sharded(path, opt)
    return pg.ops[before:]


def test_a_sharded_save_orders_the_ranks_with_a_host_barrier(monkeypatch, tmp_path):
    """Rank 0 reads every rank's shard file after a "barrier". It was an all-reduce of
    a zero: on NCCL that returns to the host before the peers arrive, so rank 0 could
    read a shard not yet written. Only a barrier orders the hosts."""
    monkeypatch.setenv("GRADSYNC_NCCL_RULES", "1")
    for ops in gs.spawn(_sharded_save_job, 2, str(tmp_path / "ckpt"), timeout_s=60):
        assert ops.count("barrier") == 3, ops
        assert "all_reduce" not in ops, ops

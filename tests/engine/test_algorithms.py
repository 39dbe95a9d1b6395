"""Reference all-reduce algorithms: bitwise the same on every rank, equal to the exact sum.

One spawn per world size (2, 3, 4) runs every case: ring, tree, parameter server
and hierarchical (ranks_per_host emulating hosts inside the spawn) on sizes that
do not divide by the world size, in float64 with integer values (the sum is then
exact, so equality with the float64 reference is the claim) and in float32 with
random values (rounding differs from a reference's, so the claim is bitwise
agreement across ranks and closeness to the reference).
"""

import threading

import pytest
import torch

import gradsync as gs
from gradsync.engine.transport import comm
from gradsync.engine.transport.algorithms import (
    ALGORITHMS,
    HostTopology,
    hierarchical,
    ring,
    server,
    tree,
)
from gradsync.errors import UsageError
from gradsync.plan.two_level import schedule

SIZES = (1, 5, 103)


def data(case: int, rank: int, numel: int, kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * case + rank)
    if kind == "int64-valued":
        return torch.randint(-1000, 1000, (numel,), generator=g).double()
    return torch.randn(numel, generator=g, dtype=torch.float32)


def cases(world: int):
    """(name, kind, numel, runner) where runner(tensor, topologies) sums in place."""
    out = []
    for kind in ("int64-valued", "float32"):
        for numel in SIZES:
            for name, fn in ALGORITHMS.items():
                out.append((name, kind, numel, lambda t, tops, fn=fn: fn(t)))
            out.append(("server root=last", kind, numel,
                        lambda t, tops: server.all_reduce_(t, root=world - 1)))
            for g in tops_for(world):
                out.append((f"hierarchical g={g}", kind, numel,
                            lambda t, tops, g=g: hierarchical.all_reduce_(t, tops[g])))
                for inner in ("tree", "server"):
                    out.append((f"hierarchical g={g} inter={inner}", kind, numel,
                                lambda t, tops, g=g, i=inner: hierarchical.all_reduce_(
                                    t, tops[g], inter=ALGORITHMS[i])))
    return out


def tops_for(world: int):
    return [g for g in range(1, world + 1) if world % g == 0]


def _worker(world: int):
    rank = gs.rank()
    tops = {g: HostTopology(ranks_per_host=g) for g in tops_for(world)}
    results = []
    events = []
    with comm.add_observer(lambda kind, ev: events.append((kind, ev.op,
                                                           ev.meta.get("algorithm")))):
        for k, (_, kind, numel, run) in enumerate(cases(world)):
            t = data(k, rank, numel, kind).view(1, -1)  # 2-D: works on any contiguous shape
            run(t, tops)
            results.append(t.view(-1).clone())
    launches = [e for e in events if e[0] == "launch"]
    # ZeRO's two-level reduce-scatter / all-gather, shards of 3 elements
    shard = []
    for g in tops_for(world):
        full = data(999, rank, 3 * world, "int64-valued")
        out = torch.empty(3, dtype=full.dtype)
        before = full.clone()
        hierarchical.reduce_scatter(out, full, tops[g])
        assert torch.equal(full, before)
        back = torch.empty_like(full)
        hierarchical.all_gather(back, out, tops[g])
        shard.append({"hosts_of": g, "shard": out, "gathered": back})
    # from a communication thread while the main thread runs another collective
    t = data(777, rank, 1001, "float32")
    other = torch.full((64,), float(rank + 1))
    worker = threading.Thread(target=hierarchical.all_reduce_, args=(t, tops[tops_for(world)[-1]]))
    worker.start()
    comm.all_reduce(other)
    worker.join(timeout=60)
    assert not worker.is_alive()
    errors = {}
    for case, bad in (("ranks_per_host", lambda: HostTopology(ranks_per_host=world + 1)),
                      ("not_contiguous", lambda: server.all_reduce_(torch.zeros(4, 4).t())),
                      ("uneven_shards", lambda: hierarchical.reduce_scatter(
                          torch.empty(1), torch.zeros(world + 1), tops[1]))):
        try:
            bad()
            errors[case] = None
        except UsageError as e:
            errors[case] = str(e)
    sent = _record_sends(tops) if world == 4 else None
    for top in tops.values():
        top.close()
    return {"cases": results, "launches": launches, "two_level": shard,
            "threaded": {"hierarchical": t, "main": other}, "errors": errors, "sent": sent}


def _record_sends(tops):
    """The (destination, bytes) of every message this rank sends, per round, per algorithm."""
    import torch.distributed as dist

    seen = []
    originals = {m: m.exchange for m in (ring, tree, server)}

    def recording(original):
        def exchange(sends, recvs, group, finish=None):
            peers = [(r if group is None else dist.get_global_rank(group, r),
                      t.numel() * t.element_size()) for t, r in sends]
            if peers:
                seen.append(sorted(peers))
            return original(sends, recvs, group, finish)
        return exchange

    runs = {"ring": ring.all_reduce_, "tree": tree.all_reduce_, "server": server.all_reduce_,
            "hierarchical": lambda t: hierarchical.all_reduce_(t, tops[2])}
    out = {}
    try:
        for m, original in originals.items():
            m.exchange = recording(original)
        for name, run in runs.items():
            seen.clear()
            run(torch.ones(48, dtype=torch.float64))
            out[name] = list(seen)
    finally:
        for m, original in originals.items():
            m.exchange = original
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_algorithm_is_bitwise_identical_across_ranks_and_exact(world):
    out = gs.spawn(_worker, world, world, timeout_s=60)
    all_cases = cases(world)
    assert len(out) == world and all(len(r["cases"]) == len(all_cases) for r in out)
    for k, (name, kind, numel, _) in enumerate(all_cases):
        got = [r["cases"][k] for r in out]
        for r in range(1, world):
            assert torch.equal(got[0], got[r]), f"{name} {kind} n={numel}: rank {r} differs"
        ref = sum(data(k, r, numel, kind).double() for r in range(world))
        if kind == "int64-valued":
            assert torch.equal(got[0], ref), f"{name} n={numel}: not the exact sum"
        else:
            torch.testing.assert_close(got[0].double(), ref, rtol=1e-5, atol=1e-5)
    # one observed all_reduce per call, named by its algorithm; no step events
    launches = out[0]["launches"]
    assert len(launches) == len(all_cases)
    assert all(op == "all_reduce" for _, op, _ in launches)
    assert [a for _, _, a in launches] == [name.split()[0] for name, *_ in all_cases]
    full = sum(data(999, r, 3 * world, "int64-valued") for r in range(world))
    for r, res in enumerate(out):
        assert [s["hosts_of"] for s in res["two_level"]] == tops_for(world)
        for s in res["two_level"]:
            g = s["hosts_of"]
            assert torch.equal(s["shard"], full[3 * r:3 * r + 3]), f"reduce_scatter g={g} rank {r}"
            assert torch.equal(s["gathered"], full), f"all_gather g={g} rank {r}"
        t, other = res["threaded"]["hierarchical"], res["threaded"]["main"]
        torch.testing.assert_close(
            t.double(), sum(data(777, q, 1001, "float32").double() for q in range(world)),
            rtol=1e-5, atol=1e-5)
        assert torch.equal(t, out[0]["threaded"]["hierarchical"])
        assert torch.equal(other, torch.full((64,), world * (world + 1) / 2))
        msgs = res["errors"]
        assert all(isinstance(m, str) for m in msgs.values()) and len(msgs) == 3, msgs
        assert "positive divisor" in msgs["ranks_per_host"]
        assert "contiguous" in msgs["not_contiguous"]
        assert "do not divide" in msgs["uneven_shards"]
    if world == 4:  # the planner prices exactly the messages the engine sends
        for r, res in enumerate(out):
            assert list(res["sent"]) == ["ring", "tree", "server", "hierarchical"]
            for name, sends in res["sent"].items():
                planned = [sorted((d, b) for s, d, b in rnd if s == r)
                           for rnd in schedule(name, 48 * 8, 2, 2)]
                assert sends and sends == [p for p in planned if p], f"{name} rank {r}"


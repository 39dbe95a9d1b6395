"""What do the desync fingerprint and the flight recorder cost? With and without, side by side.

    PYTHONPATH=src python benchmarks/fingerprint_cost.py [--rounds 12 --steps 6 --workers 2]

The built-in GPT (AdamW, micro-batch 8 x 128 tokens per rank, two micro-steps per
step: one under ``no_sync``, then a synchronised one) trains on gloo workers in two
variants built from the same weights:

* ``with``: the shipped engine: every collective numbered and folded into the
  fingerprint and kept in the flight recorder; the window's digest written into
  the item header (9 extra whole numbers riding in the first bucket) and checked;
* ``without``: the same engine with ``comm``'s recording replaced by a no-op and
  the window writing and reading only the item count (what it did before the
  fingerprint existed).

Both run on one model instance, toggled block by block: two instances of the
same model differ by a few percent in step time on their own (memory placement),
which a two-instance comparison would charge to the fingerprint.

Timed blocks alternate (with, without, then without, with, ...) inside one
invocation so a shared machine's drift hits both alike; each block's median step
is taken, and the medians of those are compared. Target: under 1% of a step.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import time

import torch
import torch.nn.functional as F

import gradsync as gs
from gradsync.engine.sync import item_window
from gradsync.engine.sync.item_window import HEADER_SLOTS, ItemWindow
from gradsync.engine.transport import comm
from gradsync.models import build_model


@contextlib.contextmanager
def without_fingerprint():
    """The engine as it was before the fingerprint: no record per collective, the
    header's extra slots left at zero and never read."""
    record = comm._record
    write, close = item_window.CheckedWindow.write, item_window.CheckedWindow.close

    def plain_write(self, slots, group=None):
        ItemWindow.write(self, slots[:HEADER_SLOTS])

    def plain_close(self, summed, plain_divisor=None):
        return ItemWindow.close(self, summed[:HEADER_SLOTS], plain_divisor)

    comm._record = lambda *args, **kwargs: None
    item_window.CheckedWindow.write, item_window.CheckedWindow.close = plain_write, plain_close
    try:
        yield
    finally:
        comm._record = record
        item_window.CheckedWindow.write, item_window.CheckedWindow.close = write, close


def _worker(a: dict) -> dict | None:
    torch.manual_seed(0)
    base = build_model("gpt")
    g = torch.Generator().manual_seed(100 + gs.rank())
    x = torch.randint(0, 256, (2, 8, 128), generator=g)
    y = torch.randint(0, 256, (2, 8, 128), generator=g)
    # one model for both: two instances differ in memory placement by a few percent,
    # which would be charged to the fingerprint; the blocks toggle it instead
    m = gs.DataParallel(copy.deepcopy(base))
    shared = (m, torch.optim.AdamW(m.parameters(), lr=1e-4))
    variants = {"with": shared, "without": shared}

    def step(kind: str) -> tuple[float, float]:
        m, opt = variants[kind]
        t0, c0 = time.perf_counter(), time.thread_time()
        for k in range(2):
            with m.no_sync() if k == 0 else contextlib.nullcontext():
                logits = m(x[k])
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y[k].reshape(-1))
                m.backward(loss, num_items=y[k].numel())
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - t0, time.thread_time() - c0

    def block(kind: str, steps: int) -> tuple[float, float]:
        ctx = without_fingerprint() if kind == "without" else contextlib.nullcontext()
        with ctx:
            runs = [step(kind) for _ in range(steps)]
        return statistics.median(w for w, _ in runs), statistics.median(c for _, c in runs)

    for kind in variants:  # warm-up, including the bucket rebuild
        block(kind, 2)
    blocks: dict[str, list[tuple[float, float]]] = {k: [] for k in variants}
    order = list(variants)
    for r in range(a["rounds"]):
        for kind in (order if r % 2 == 0 else order[::-1]):
            blocks[kind].append(block(kind, a["steps"]))
    return {"blocks": blocks, "per_collective_s": _record_cost()} if gs.rank() == 0 else None


def _record_cost(n: int = 20000) -> float:
    """Seconds one collective's numbering, folding and recording costs, timed alone."""
    from gradsync.engine.transport import flight_recorder

    t = torch.zeros(1000)
    t0 = time.perf_counter()
    for _ in range(n):
        flight_recorder.end(flight_recorder.begin("all_reduce", t, None, "bench"))
    return (time.perf_counter() - t0) / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=12, help="timed blocks per variant")
    p.add_argument("--steps", type=int, default=6, help="steps per block")
    p.add_argument("--workers", type=int, default=2)
    a = vars(p.parse_args())
    out = gs.spawn(_worker, a.pop("workers"), a)[0]
    blocks = out["blocks"]
    print(f"built-in GPT, rank 0: median of {a['rounds']} block medians of {a['steps']} steps "
          "(2 micro-steps each); wall = step time, cpu = the training thread's CPU time")
    med = {}
    for k in ("without", "with"):
        med[k] = [statistics.median(b[i] for b in blocks[k]) for i in (0, 1)]
        print(f"  {k:8} wall {med[k][0] * 1e3:9.2f} ms/step   cpu {med[k][1] * 1e3:9.2f} ms/step")
    print(f"  ratio with/without: wall {med['with'][0] / med['without'][0]:.4f}, "
          f"cpu {med['with'][1] / med['without'][1]:.4f}")
    print(f"  one collective's record, timed alone: {out['per_collective_s'] * 1e6:.2f} us")


if __name__ == "__main__":
    main()

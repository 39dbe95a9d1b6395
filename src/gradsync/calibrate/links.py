"""Intra-host and inter-host alpha/beta, measured with the messages the algorithms send.

``plan.two_level`` prices an all-reduce round by round: a message inside a host
at the intra link's alpha/beta, the bytes leaving a host at the inter link's. This
measures those two links the way the rounds use them: two ranks exchange n bytes
both ways at once (one ring round between two ranks: an isend and an irecv each,
through ``engine.comm.exchange``), timed at log-spaced sizes while every other rank
waits at a barrier. The intra pair is global ranks 0 and 1 (host 0; only with 2 or
more ranks per host), the inter pair ranks 0 and g (local rank 0 of hosts 0 and 1).
A repetition's time is the slower of the pair; a size's figure is the median over
repetitions; alpha and beta come from ``plan.calibrate_fit`` (relative least
squares), so beta is seconds per byte of one direction of one link.

Runs under torchrun on real hosts or emulated ones::

    torchrun --nnodes 2 --nproc-per-node 2 ... -m gradsync.calibrate.links --out links.json
    gradsync netlab calibrate --hosts 2 --procs-per-host 2 --rate 100mbit --out links.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from ..errors import UsageError
from ..plan.calibrate_fit import AlphaBetaFit, fit_alpha_beta
from ..plan.two_level import Link, TwoLevelTopology

LINKS_VERSION = 1


@dataclass(frozen=True)
class LinkTiming:
    """One link's medians per size (slower of the pair per repetition) and its fit."""

    link: str  # "intra" or "inter"
    pair: tuple[int, int]
    nbytes: tuple[int, ...]
    median_s: tuple[float, ...]
    fit: AlphaBetaFit

    def as_link(self) -> Link:
        return Link(self.fit.alpha_s, self.fit.beta_s_per_byte)


@dataclass(frozen=True)
class LinkCalibration:
    hosts: int
    ranks_per_host: int
    reps: int
    inter: LinkTiming
    intra: LinkTiming | None  # None with one rank per host
    rate: str | None = None  # the emulated link's nominal rate, when measured on netlab

    def topology(self, hosts: int | None = None, ranks_per_host: int | None = None
                 ) -> TwoLevelTopology:
        """The planner's view; hosts and ranks per host may differ from those measured on.

        Without an intra measurement the intra link is free (alpha = beta = 0): fine
        for one rank per host, where no message stays inside a host.
        """
        intra = self.intra.as_link() if self.intra is not None else Link(0.0, 0.0)
        return TwoLevelTopology(hosts or self.hosts, ranks_per_host or self.ranks_per_host,
                                intra, self.inter.as_link())


# -- the measurement (inside torchrun workers) ---------------------------------------------

def _time_pair(pair: tuple[int, int], sizes: Sequence[int], reps: int, warmup: int = 1
               ) -> list[list[float]]:
    """Per size, per repetition: this rank's time for one exchange (0 if not in ``pair``)."""
    import torch
    import torch.distributed as dist

    from ..engine.transport import comm
    from ..engine.transport.algorithms.rounds import exchange

    me = dist.get_rank()
    rows = []
    for n in sizes:
        inner = max(1, min(8, (1 << 20) // max(n, 1)))
        buf_out, buf_in = torch.ones(n // 4), torch.empty(n // 4)
        peer = pair[1] if me == pair[0] else pair[0]

        def once(buf_out=buf_out, buf_in=buf_in, peer=peer):
            exchange([(buf_out, peer)], [(buf_in, peer)], None)

        times = []
        for k in range(warmup + reps):
            comm.barrier(tag="calibrate")
            if me not in pair:
                continue
            t0 = time.perf_counter()
            for _ in range(inner):
                once()
            if k >= warmup:
                times.append((time.perf_counter() - t0) / inner)
        rows.append(times if me in pair else [0.0] * reps)
    return rows


def measure_worker(sizes: Sequence[int], reps: int) -> dict | None:
    """On every rank (after gs.init()); returns the payload on rank 0, None elsewhere."""
    import torch
    import torch.distributed as dist

    from ..engine.transport import comm
    from ..engine.transport.algorithms import HostTopology

    top = HostTopology.from_env()
    g, world = top.ranks_per_host, top.world_size
    if top.num_hosts < 2:
        raise UsageError("calibrating links needs at least 2 hosts (torchrun --nnodes >= 2)")
    links = {"inter": (0, g)}
    if g >= 2:
        links["intra"] = (0, 1)
    mine = {name: _time_pair(pair, sizes, reps) for name, pair in links.items()}
    flat = torch.tensor([t for name in links for row in mine[name] for t in row],
                        dtype=torch.float64)
    table = torch.empty(world * flat.numel(), dtype=torch.float64)
    comm.all_gather_single(table, flat, tag="calibrate-links")
    top.close()
    if dist.get_rank() != 0:
        return None
    table = table.view(world, len(links), len(sizes), reps)
    payload = {"version": LINKS_VERSION, "hosts": top.num_hosts, "ranks_per_host": g,
               "sizes": list(sizes), "reps": reps}
    for k, (name, pair) in enumerate(links.items()):
        slowest = torch.maximum(table[pair[0], k], table[pair[1], k])
        payload[name] = {"pair": list(pair), "seconds": slowest.tolist()}
    return payload


def summarise(payload: dict, rate: str | None = None) -> LinkCalibration:
    """Median per size and the alpha-beta fit of each link."""
    if payload.get("version") != LINKS_VERSION:
        raise UsageError(f"link calibration version {payload.get('version')!r} is not "
                         f"{LINKS_VERSION}; re-run the calibration")
    sizes = [int(s) for s in payload["sizes"]]

    def timing(name):
        if name not in payload:
            return None
        d = payload[name]
        medians = [statistics.median(row) for row in d["seconds"]]
        return LinkTiming(name, tuple(d["pair"]), tuple(sizes), tuple(medians),
                          fit_alpha_beta(sizes, medians))

    return LinkCalibration(int(payload["hosts"]), int(payload["ranks_per_host"]),
                           int(payload["reps"]), timing("inter"), timing("intra"), rate)


def calibration_to_json(cal: LinkCalibration) -> str:
    return json.dumps({"version": LINKS_VERSION, **asdict(cal)}, indent=1)


def calibration_from_json(text: str) -> LinkCalibration:
    d = json.loads(text)
    if not isinstance(d, dict):
        raise UsageError(f"it holds a JSON {type(d).__name__}, not a links file's object")
    if d.get("version") != LINKS_VERSION:
        raise UsageError(f"links file version {d.get('version')!r} is not {LINKS_VERSION}")

    def timing(t):
        if t is None:
            return None
        return LinkTiming(t["link"], tuple(t["pair"]), tuple(t["nbytes"]), tuple(t["median_s"]),
                          AlphaBetaFit(**t["fit"]))

    return LinkCalibration(d["hosts"], d["ranks_per_host"], d["reps"], timing(d["inter"]),
                           timing(d["intra"]), d.get("rate"))


def default_link_sizes(quick: bool) -> list[int]:
    """4 KB .. 16 MB in 7 sizes (quick: 4 KB .. 4 MB in 5).

    On netlab, messages up to the token bucket's burst (32 KiB) pass at memory speed
    when the bucket is full, so the smallest sizes pin alpha and the largest the
    rate; the fit is a compromise between them, with its worst residual shown.
    """
    from .collectives import log_sizes

    return log_sizes(4096, 4 << 20, 5) if quick else log_sizes(4096, 16 << 20, 7)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m gradsync.calibrate.links --out FILE`` under torchrun (raw payload JSON)."""
    import torch

    import gradsync as gs

    p = argparse.ArgumentParser(prog="python -m gradsync.calibrate.links",
                                description="time intra- and inter-host exchanges")
    p.add_argument("--out", required=True, help="payload JSON written by rank 0")
    p.add_argument("--sizes", help="comma-separated message sizes in bytes")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    sizes = ([int(s) for s in args.sizes.split(",")] if args.sizes
             else default_link_sizes(args.quick))
    torch.set_num_threads(1)
    gs.init()
    payload = measure_worker(sizes, args.reps)
    if payload is not None:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(payload, f)
    gs.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Does the calibrated simulator predict the real DataParallel step time?

    PYTHONPATH=src python benchmarks/predict_vs_measured.py [--models gpt mlp] [--workers 2]
        [--buckets 0.25 1 4 16 64] [--rounds 30] [--json]

For each model, K workers are started once. Each first times all-reduce over
4 KB..64 MB (alpha and beta), then runs rounds; a round is one calibration pass
(DataParallel under no_sync, all K computing at once, as ``gradsync calibrate``
measures; every second round also the overlap penalties) and then one real
synchronised DataParallel step at every bucket size, visiting the sizes in
alternating directions so machine noise (2 shared cores) hits calibration and
every size alike.
The prediction for a size is ``simulate_step`` on the profile built from the
rounds' medians; the measurement is the median over all its timed steps. Prints
bucket MB, predicted ms, measured ms and error %, and the median absolute error
(target: at most 15%); also a paired error (median over rounds of
each round's prediction over that round's step, which cancels slow drift in the
machine's load) and the error of the same profile with free overlap.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch.distributed as dist

from gradsync.calibrate.backward import median_timing, time_passes
from gradsync.calibrate.collectives import log_sizes, summarise, time_collectives_worker
from gradsync.calibrate.overlap import measure_overlap_worker
from gradsync.calibrate.workload import build_workload
from gradsync.plan.simulate import simulate_step


def _dp(spec: str, bucket_mb: float):
    from gradsync.engine.replicated.data_parallel import DataParallel

    work = build_workload(spec)
    dp = DataParallel(work.model, bucket_cap_mb=bucket_mb)
    return work, dp, work.make_optimizer(list(dp.parameters()))


def _step(work, dp, opt) -> float:
    t0 = time.perf_counter()
    loss = work.loss(dp)
    loss.backward()
    opt.step()
    dp.zero_grad()
    return time.perf_counter() - t0


def _worker(spec, buckets, rounds, sizes, reps):
    coll = time_collectives_worker(("all_reduce",), sizes, reps)
    spb = statistics.median(coll["all_reduce"][-1]) / sizes[-1]
    cal_work, cal_dp, cal_opt = _dp(spec, 25.0)
    wrapped = {b: _dp(spec, b) for b in buckets}
    for b in buckets:  # warm-up, and the engine's one-off bucket rebuild
        for _ in range(2):
            _step(*wrapped[b])
    with cal_dp.no_sync():
        time_passes(cal_work, cal_dp, 1, 1, cal_dp.zero_grad, cal_opt)
    timings, overlaps, measured = [], [], {b: [] for b in buckets}
    for r in range(rounds):
        # One calibration pass and one step per size per round, in alternating
        # order: noise from the shared machine lands on every column alike.
        dist.barrier()
        with cal_dp.no_sync():
            timings.append(time_passes(cal_work, cal_dp, 1, 0, cal_dp.zero_grad, cal_opt))
        if r % 2 == 0:
            overlaps.append(measure_overlap_worker(cal_work, cal_dp, timings[-1].backward_s,
                                                   spb, reps=1))
        for b in (buckets if r % 2 == 0 else list(reversed(buckets))):
            dist.barrier()
            measured[b].append(_step(*wrapped[b]))
    return coll, timings, overlaps, measured


def run_model(spec, workers, buckets, rounds):
    from gradsync.launch import spawn

    sizes = log_sizes(4096, 64 << 20, 7)
    results = spawn(_worker, workers, spec, tuple(buckets), rounds, tuple(sizes), 5)
    coll = summarise([r[0] for r in results], sizes, 5)
    timings, overlaps, measured = results[0][1], results[0][2], results[0][3]
    timing = median_timing(timings)
    f = statistics.median(o.compute for o in overlaps)
    g = statistics.median(o.comm for o in overlaps)
    plain = timing.to_profile(coll.alpha_s, coll.beta_s_per_byte, workers)
    shared = timing.to_profile(coll.alpha_s, coll.beta_s_per_byte, workers, f, g)
    rows = []
    for b in buckets:
        pred = simulate_step(shared, b).step_s
        free = simulate_step(plain, b).step_s
        meas = statistics.median(measured[b])
        # Paired: each round's step against the prediction from that round's own
        # calibration pass, which cancels drift in the machine's load over the run.
        ratios = [simulate_step(t.to_profile(coll.alpha_s, coll.beta_s_per_byte, workers, f, g),
                                b).step_s / m for t, m in zip(timings, measured[b])]
        rows.append({"bucket_mb": b, "predicted_ms": pred * 1e3, "measured_ms": meas * 1e3,
                     "error_pct": 100.0 * (pred - meas) / meas,
                     "paired_error_pct": 100.0 * (statistics.median(ratios) - 1.0),
                     "free_overlap_ms": free * 1e3,
                     "free_overlap_error_pct": 100.0 * (free - meas) / meas})
    fit = coll.ops["all_reduce"].fit
    return {
        "model": spec, "workers": workers, "alpha_ms": coll.alpha_s * 1e3,
        "bandwidth_GBps": 1e-9 / coll.beta_s_per_byte if coll.beta_s_per_byte else None,
        "fit_r2": fit.r2,
        "backward_ms": timing.backward_s * 1e3,
        "forward_ms": timing.forward_s * 1e3,
        "optimizer_ms": timing.optimizer_s * 1e3,
        "overlap_compute_penalty": f,
        "overlap_comm_penalty": g,
        "rows": rows,
        "median_abs_error_pct": statistics.median(abs(r["error_pct"]) for r in rows),
        "paired_median_abs_error_pct": statistics.median(
            abs(r["paired_error_pct"]) for r in rows),
        "free_overlap_median_abs_error_pct": statistics.median(
            abs(r["free_overlap_error_pct"]) for r in rows),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["gpt", "mlp"])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--buckets", nargs="+", type=float, default=[0.25, 1, 4, 16, 64])
    ap.add_argument("--rounds", type=int, default=30,
                    help="rounds of (one calibration pass, one step per bucket size)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    reports = [run_model(m, args.workers, args.buckets, args.rounds) for m in args.models]
    if args.json:
        print(json.dumps(reports, indent=1))
        return 0
    from rich.console import Console
    from rich.table import Table

    console = Console()
    all_errors = []
    for rep in reports:
        t = Table(title=(f"{rep['model']}, K={rep['workers']}: alpha {rep['alpha_ms']:.2f} ms, "
                         f"{rep['bandwidth_GBps']:.2f} GB/s (R² {rep['fit_r2']:.3f}); fwd "
                         f"{rep['forward_ms']:.1f} ms, bwd {rep['backward_ms']:.1f} ms, opt "
                         f"{rep['optimizer_ms']:.1f} ms; overlap penalties f "
                         f"{rep['overlap_compute_penalty']:.2f}, g "
                         f"{rep['overlap_comm_penalty']:.2f}"))
        for col in ("bucket MB", "predicted ms", "measured ms", "error %", "paired error %",
                    "free-overlap model ms", "its error %"):
            t.add_column(col, justify="right")
        for r in rep["rows"]:
            t.add_row(f"{r['bucket_mb']:g}", f"{r['predicted_ms']:.1f}",
                      f"{r['measured_ms']:.1f}", f"{r['error_pct']:+.1f}",
                      f"{r['paired_error_pct']:+.1f}",
                      f"{r['free_overlap_ms']:.1f}", f"{r['free_overlap_error_pct']:+.1f}")
            all_errors.append(abs(r["error_pct"]))
        console.print(t)
        console.print(f"median |error| {rep['median_abs_error_pct']:.1f}% (paired "
                      f"{rep['paired_median_abs_error_pct']:.1f}%; free-overlap model "
                      f"{rep['free_overlap_median_abs_error_pct']:.1f}%)")
    console.print(f"overall median |error| {statistics.median(all_errors):.1f}% (target <= 15%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

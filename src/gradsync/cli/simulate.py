"""`gradsync simulate`: one step's backward/all-reduce overlap, the bucket sweep, pictures.

Without ``--profile`` it simulates a uniform L-layer model from flags, so the
command works before any calibration; with ``--profile FILE`` it reads the JSON
``gradsync calibrate`` writes (flags given explicitly override its link numbers).
"""

from __future__ import annotations

import argparse

from ..errors import UsageError
from ..plan.profile import load_profile, synthetic_profile
from ..plan.simulate import (
    DEFAULT_BUCKET_MB,
    DEFAULT_FIRST_BUCKET_MB,
    simulate_step,
    sweep_bucket_sizes,
)
from ..plan.units import parse_count, parse_rate, parse_time
from ._common import positive

EPILOG = """\
Bucket sizes are in MB as DDP counts them (MiB); bandwidth GB/s = 1e9 bytes/s.
examples:
  gradsync simulate --layers 24 --params-per-layer 1M --backward-ms 2 --workers 2
  gradsync simulate --profile profile.json --bucket-mb 50 --timeline-png t.png
  gradsync simulate --html page.html        (one self-contained interactive file)"""


def register(subparsers, help_line: str):
    p = subparsers.add_parser(
        "simulate", help=help_line, description=help_line, epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--profile", metavar="FILE", help="JSON profile (from gradsync calibrate)")
    m = p.add_argument_group("synthetic uniform model (when no --profile)")
    m.add_argument("--layers", type=int, default=24, help="number of uniform layers")
    m.add_argument("--params-per-layer", default="1M", help="elements per layer (1M, 4e6)")
    m.add_argument("--tensors-per-layer", type=int, default=4,
                   help="parameters per layer (each layer's elements split evenly)")
    m.add_argument("--itemsize", type=int, default=4, help="bytes per gradient element")
    m.add_argument("--backward-ms", type=float, default=2.0, help="backward time per layer")
    m.add_argument("--forward-ms", type=float, help="whole forward (default: half of backward)")
    m.add_argument("--optimizer-ms", type=float, default=0.0, help="optimizer step time")
    c = p.add_argument_group("communication")
    c.add_argument("--workers", "-n", type=int, help="world size N (default 2)")
    c.add_argument("--bandwidth", help="link (bus) bandwidth, = measured S/t x 2(N-1)/N "
                   "(default 1GB/s)")
    c.add_argument("--latency", help="alpha per all-reduce (default 1ms)")
    s = p.add_argument_group("schedule")
    s.add_argument("--bucket-mb", type=float, default=DEFAULT_BUCKET_MB,
                   help="bucket cap, MiB (DDP's bucket_cap_mb)")
    s.add_argument("--first-bucket-mb", type=float, default=DEFAULT_FIRST_BUCKET_MB,
                   help="cap of the first bucket, MiB (launches early in backward)")
    s.add_argument("--accum", type=int, default=1, help="micro-steps per optimizer step")
    o = p.add_argument_group("output")
    o.add_argument("--timeline-png", metavar="FILE", help="compute/comm lanes, exposed shaded")
    o.add_argument("--sweep-png", metavar="FILE", help="step time vs bucket size, 1 MB..2 GB")
    o.add_argument("--html", metavar="FILE", help="self-contained interactive page")
    o.add_argument("--json", action="store_true", help="print result and sweep as JSON")
    p.set_defaults(run=run)
    return p


def _profile(args):
    """Returns (profile, synthetic kwargs or None)."""
    bw = parse_rate(args.bandwidth, "--bandwidth") if args.bandwidth else None
    alpha = parse_time(args.latency, "--latency") if args.latency else None
    positive(args.workers, "--workers")
    if args.profile:
        prof = load_profile(args.profile)
        changes = {}
        if bw is not None:
            changes["beta_s_per_byte"] = 1.0 / bw
        if alpha is not None:
            changes["alpha_s"] = alpha
        if args.workers is not None:
            changes["world_size"] = args.workers
        return (prof.with_(**changes) if changes else prof), None
    for flag, v in (("--layers", args.layers), ("--tensors-per-layer", args.tensors_per_layer),
                    ("--itemsize", args.itemsize)):
        positive(v, flag)
    positive(args.backward_ms, "--backward-ms", allow_zero=True)
    positive(args.forward_ms, "--forward-ms", allow_zero=True)
    positive(args.optimizer_ms, "--optimizer-ms", allow_zero=True)
    kw = dict(
        layers=args.layers,
        params_per_layer=parse_count(args.params_per_layer, "--params-per-layer"),
        backward_s_per_layer=args.backward_ms * 1e-3,
        tensors_per_layer=args.tensors_per_layer,
        itemsize=args.itemsize,
        forward_s=None if args.forward_ms is None else args.forward_ms * 1e-3,
        optimizer_s=args.optimizer_ms * 1e-3,
        alpha_s=1e-3 if alpha is None else alpha,
        bandwidth=1e9 if bw is None else bw,
        world_size=2 if args.workers is None else args.workers,
    )
    return synthetic_profile(**kw), kw


def run(args) -> int:
    positive(args.bucket_mb, "--bucket-mb")
    positive(args.first_bucket_mb, "--first-bucket-mb")
    positive(args.accum, "--accum")
    profile, synthetic = _profile(args)
    result = simulate_step(profile, args.bucket_mb, args.first_bucket_mb, args.accum)
    sweep = sweep_bucket_sizes(profile, first_bucket_mb=args.first_bucket_mb,
                               accum_steps=args.accum)
    if args.json:
        import dataclasses
        import json

        print(json.dumps({"result": dataclasses.asdict(result),
                          "sweep": dataclasses.asdict(sweep)}, indent=1))
    else:
        from ..observe.plan_tables import print_table, simulate_table

        print_table(simulate_table(result, sweep))
    if args.timeline_png or args.sweep_png:
        from ..observe.plan_plots import sweep_png, timeline_png

        if args.timeline_png:
            timeline_png(result, args.timeline_png)
        if args.sweep_png:
            sweep_png(sweep, args.sweep_png)
    if args.html:
        from ..observe.simulate_page import render_simulate_page

        page = render_simulate_page(profile, result, sweep, synthetic)
        try:
            with open(args.html, "w", encoding="utf-8") as f:
                f.write(page)
        except OSError as e:
            raise UsageError(f"cannot write {args.html}: {e.strerror}") from None
    return 0


"""The slow-link benchmark's methods and workloads: what runs, with which flags.

One table of `gradsync train` flags per method and per workload, shared by the
runner (``slow_link.py``), the judging (``slow_link_judge.py``: which evaluations
count for a local-update method) and the picture (a colour and a line style per
method).
"""

from __future__ import annotations

NO_PROBE = ["--probe-every", "0"]
"""Compressed runs skip `gradsync train`'s exact-gradient probe (an exact all-reduce every
25 steps, to record the compressed gradient's distance): a diagnostic, not part of the
method, and over a slow link it costs an exact step each time."""

METHODS: dict[str, list[str]] = {
    "torch-ddp": ["--strategy", "torch-ddp"],
    "exact": [],
    "hierarchical": ["--collectives", "hierarchical"],
    "bf16": ["--compress", "bf16", *NO_PROBE],
    "fp16": ["--compress", "fp16", *NO_PROBE],
    "int8": ["--compress", "int8", *NO_PROBE],
    "powersgd:4": ["--compress", "powersgd:4", *NO_PROBE],
    "diloco-25": ["--sync", "diloco", "--sync-every", "25"],
    "diloco-100": ["--sync", "diloco", "--sync-every", "100"],
    "streaming": ["--sync", "streaming-diloco", "--sync-every", "25", "--fragments", "4",
                  "--sync-delay", "1", "--sync-alpha", "0.5"],
    "diloco-25-hosts": ["--sync", "diloco", "--sync-every", "25", "--collectives",
                        "hierarchical"],
    "streaming-hosts": ["--sync", "streaming-diloco", "--sync-every", "25", "--fragments", "4",
                        "--sync-delay", "1", "--sync-alpha", "0.5", "--collectives",
                        "hierarchical"],
    "no-sync": ["--sync", "diloco", "--sync-every", "1000000000"],
    "diloco-25-4x": ["--sync", "diloco", "--sync-every", "25"],
    "diloco-25-const": ["--sync", "diloco", "--sync-every", "25", "--schedule", "constant"],
    "torch-ddp-const": ["--strategy", "torch-ddp", "--schedule", "constant"],
}
"""method -> its `gradsync train` flags (on top of the workload's)."""

SAMPLES_X = {"diloco-25-4x": 4}
"""Methods given a multiple of the common sample budget (steps; the schedule stretches
with them): outside the equal-budget comparison, shown as such. On a slow link data is
cheap and bandwidth is not, so "how soon does DiLoCo get there if it may read more" is
the practical question when it cannot at equal samples."""

WORKLOADS: dict[str, dict] = {
    # Communication-bound: 8.4 M parameters (32 MiB of float32 gradient) and little compute.
    "mlp": {"steps": 100, "eval_every": 5,
            "flags": ["--model", "slow_link_worker:mlp", "--data", "teacher",
                      "--optimizer", "adamw", "--lr", "1e-3", "--warmup", "10",
                      "--global-batch", "128", "--micro-batch", "32"]},
    # The built-in GPT (0.84 M parameters) on the standard library's sources.
    "gpt": {"steps": 200, "eval_every": 10,
            "flags": ["--model", "gpt", "--data", "pysrc", "--optimizer", "adamw",
                      "--lr", "3e-3", "--warmup", "20", "--global-batch", "16",
                      "--micro-batch", "4", "--seq-len", "128"]},
}

LOCAL = {"diloco-25": 25, "diloco-100": 100, "streaming": None, "no-sync": None,
         "diloco-25-4x": 25, "diloco-25-const": 25, "diloco-25-hosts": 25,
         "streaming-hosts": None}
"""Local-update methods -> the interval at which their replicas are identical (None: only
at the end of the run)."""

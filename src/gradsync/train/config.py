"""TrainConfig: every option of `gradsync train`, one flag per field.

The same parser serves ``gradsync train`` (which launches the workers) and
``torchrun -m gradsync.train`` (where torchrun already did), so the two can never
disagree about what a flag means.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass, field, fields

from ..dist import BACKENDS
from ..errors import UsageError

MODEL_CHOICES = ("gpt", "mlp")
STRATEGY_CHOICES = ("ddp", "zero1", "zero2", "zero3")  # engine/strategy.py's STRATEGIES
PRECISION_CHOICES = ("fp32", "bf16")
DATA_CHOICES = ("pysrc", "random-tokens", "teacher")
DATA_FOR_MODEL = {"gpt": ("pysrc", "random-tokens"), "mlp": ("teacher",)}
DEFAULT_DATA = {"gpt": "pysrc", "mlp": "teacher"}


@dataclass
class TrainConfig:
    workers: int = field(default=2, metadata={"help": "worker processes on this node (gradsync train only; torchrun sets its own)"})
    steps: int = field(default=300, metadata={"help": "optimizer steps to run"})
    global_batch: int = field(default=16, metadata={"help": "samples per optimizer step over all workers = micro-batch x accumulation x workers"})
    micro_batch: int = field(default=8, metadata={"help": "samples per forward/backward on one worker"})
    lr: float = field(default=3e-3, metadata={"help": "peak learning rate (linear warm-up, cosine decay to 10%%)"})
    warmup: int = field(default=20, metadata={"help": "warm-up steps"})
    bucket_mb: float | str = field(default=25.0, metadata={"help": "gradient bucket cap in MiB (DDP's default is 25), or 'auto' to measure candidates during the first steps and keep the fastest", "type": lambda v: v if v == "auto" else float(v)})
    seed: int = field(default=0, metadata={"help": "seed for model initialisation and data order"})
    out: str = field(default="", metadata={"help": "run directory for metrics.jsonl, checkpoint.pt and summary.json (default runs/<date-time>)"})
    backend: str = field(default="auto", metadata={"help": "process-group backend: auto (nccl with CUDA, else gloo), gloo or nccl", "choices": BACKENDS})
    model: str = field(default="gpt", metadata={"help": "built-in model: gpt (small causal LM) or mlp (8x1024 GELU MLP)", "choices": MODEL_CHOICES})
    data: str = field(default="", metadata={"help": "data: pysrc (Python stdlib sources, offline), random-tokens (benchmarking), teacher (regression for mlp); default follows --model", "choices": ("",) + DATA_CHOICES})
    strategy: str = field(default="ddp", metadata={"help": "ddp: replicate everything; zero1: shard optimizer state; zero2: also gradients; zero3: also parameters (FSDP)", "choices": STRATEGY_CHOICES})
    precision: str = field(default="fp32", metadata={"help": "fp32, or bf16: compute in bf16 with fp32 master weights, optimizer state and gradient reduction", "choices": PRECISION_CHOICES})
    seq_len: int = field(default=128, metadata={"help": "tokens per sample for the gpt model"})
    clip: float = field(default=1.0, metadata={"help": "clip the global gradient norm to this value (0 disables)"})
    checkpoint_every: int = field(default=100, metadata={"help": "save a checkpoint every N steps (and always at the end; 0: only at the end)"})
    resume: bool = field(default=False, metadata={"help": "continue from the checkpoint in --out"})
    timeout: float = field(default=300.0, metadata={"help": "seconds a collective may wait before the run fails"})
    port: int = field(default=0, metadata={"help": "rendezvous port on localhost (0: pick a free one)"})
    trace: bool = field(default=False, metadata={"help": "record a Chrome trace (trace.json: forward, backward, each bucket's all-reduce, waits, optimizer; one process per rank) for the --trace-steps window"})
    trace_steps: str = field(default="", metadata={"help": "steps to trace, FIRST:LAST (1-based, inclusive) or one step; implies --trace (default with --trace: 3:5, clipped to the run)"})
    drift_every: int = field(default=50, metadata={"help": "compare a checksum of every parameter across workers every N steps and at the end; a mismatch stops the run naming the parameter (0: off)"})
    baseline: bool = field(default=False, metadata={"help": "first run a short 1-worker baseline with the same micro-batch and accumulation (in OUT/baseline) to report scaling efficiency (gradsync train only)"})
    baseline_steps: int = field(default=8, metadata={"help": "steps of the --baseline run"})
    no_report: bool = field(default=False, metadata={"help": "do not write report.html and its figures at the end of the run"})

    def __post_init__(self) -> None:
        positive = ("workers", "steps", "global_batch", "micro_batch", "seq_len")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value!r}")
        if self.bucket_mb != "auto" and not (isinstance(self.bucket_mb, (int, float)) and self.bucket_mb > 0):
            raise UsageError(f"--bucket-mb must be > 0 or 'auto', got {self.bucket_mb!r}")
        for name in ("lr", "timeout"):
            if not getattr(self, name) > 0:
                raise UsageError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)!r}")
        if self.warmup < 0 or self.checkpoint_every < 0 or self.clip < 0:
            raise UsageError("--warmup, --checkpoint-every and --clip must be >= 0")
        if not 0 <= self.port <= 65535:
            raise UsageError(f"--port must be in 0..65535, got {self.port}")
        if self.model not in MODEL_CHOICES:
            raise UsageError(f"unknown model {self.model!r}; choose from {', '.join(MODEL_CHOICES)}")
        if self.backend not in BACKENDS:
            raise UsageError(f"unknown backend {self.backend!r}; choose from {', '.join(BACKENDS)}")
        if self.strategy not in STRATEGY_CHOICES:
            raise UsageError(f"unknown strategy {self.strategy!r}; choose from {', '.join(STRATEGY_CHOICES)}")
        if self.precision not in PRECISION_CHOICES:
            raise UsageError(f"unknown precision {self.precision!r}; choose from {', '.join(PRECISION_CHOICES)}")
        if self.bucket_mb == "auto" and self.strategy != "ddp":
            raise UsageError("--bucket-mb auto needs --strategy ddp: sharded optimizer state "
                             "needs a fixed bucket layout")
        if not self.data:
            self.data = DEFAULT_DATA[self.model]
        if self.data not in DATA_FOR_MODEL[self.model]:
            raise UsageError(f"--data {self.data} does not fit --model {self.model}; "
                             f"use one of {', '.join(DATA_FOR_MODEL[self.model])}")
        if not self.out:
            self.out = time.strftime("runs/%Y%m%d-%H%M%S")
        if self.drift_every < 0 or self.baseline_steps < 1:
            raise UsageError("--drift-every must be >= 0 and --baseline-steps >= 1")
        if self.trace_steps:
            self.trace = True
        self.trace_window()

    def trace_window(self) -> tuple[int, int] | None:
        """The traced steps (1-based, inclusive), or None; checked against --steps."""
        if not self.trace:
            return None
        if not self.trace_steps:
            first = min(3, self.steps)
            return first, min(first + 2, self.steps)
        text = self.trace_steps.strip()
        parts = text.split(":")
        try:
            if len(parts) == 1:
                first = last = int(parts[0])
            elif len(parts) == 2:
                first, last = int(parts[0]), int(parts[1])
            else:
                raise ValueError
        except ValueError:
            raise UsageError(f"--trace-steps must be FIRST:LAST or one step number, "
                             f"got {self.trace_steps!r}") from None
        if first < 1 or last < first:
            raise UsageError(f"--trace-steps {text}: need 1 <= FIRST <= LAST")
        if last > self.steps:
            raise UsageError(f"--trace-steps {text} goes beyond the last step (--steps "
                             f"{self.steps}); choose a window within 1:{self.steps}")
        return first, last

    def accumulation(self, world_size: int) -> int:
        """Micro-steps per optimizer step; the global batch must divide exactly."""
        per_step = self.micro_batch * world_size
        if self.global_batch % per_step:
            lower = max(per_step, self.global_batch // per_step * per_step)
            raise UsageError(
                f"--global-batch {self.global_batch} is not a multiple of --micro-batch "
                f"{self.micro_batch} x {world_size} workers = {per_step}; try --global-batch "
                f"{lower} or {lower + per_step}")
        return self.global_batch // per_step

    def to_dict(self) -> dict:
        return asdict(self)


def add_arguments(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """One flag per TrainConfig field, with the field's help text."""
    for f in fields(TrainConfig):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        meta = dict(f.metadata)
        help_text = meta.pop("help")
        if f.type in (bool, "bool"):
            parser.add_argument(flag, action="store_true", help=help_text)
            continue
        kind = meta.pop("type", None) or {"int": int, "float": float, "str": str}.get(str(f.type), str)
        default = f.default
        shown = "" if default in ("", None) else f" (default: {default})"
        parser.add_argument(flag, type=kind, default=default, help=help_text + shown, **meta)


def from_args(args: argparse.Namespace) -> TrainConfig:
    values = {f.name: getattr(args, f.name) for f in fields(TrainConfig) if hasattr(args, f.name)}
    return TrainConfig(**values)

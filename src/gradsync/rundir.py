"""The run directory: the one home of its file names and of what its files hold.

``gradsync train`` (``train/``) writes a run directory and ``gradsync report``
(``observe/``) reads it; both take the names and the record schemas from here,
so a field renamed on one side cannot silently vanish on the other. Torch-free:
the report and the planner import it without pulling in the engine.

How the files are written and read (atomically, whole lines only, tolerantly):
:mod:`gradsync.runfiles`. JSON written there is always valid JSON: a NaN or
infinite float (a diverged loss, a step time never measured) is written as
``null``, because Python's ``json`` would otherwise emit the bare token ``NaN``
that other readers (browsers, ``jq``) refuse. ``metrics.jsonl`` is read through
:func:`read_metrics_file` and its siblings here, which drop (with a note) any record
whose fields are not of the kinds :class:`StepRecord` and :data:`RESTART_FIELDS`
declare: a run directory may come from someone else, or another tool may have
written its lines, and ``{"epoch": 1}`` or ``{"step": "seven"}`` must not crash the
report (:func:`record_problem`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from . import runfiles
from .runfiles import (  # noqa: F401 - the writing and reading, re-exported for callers
    TMP_PREFIX,
    MetricsFile,
    MetricsWriter,
    clean,
    dumps,
    read_json,
    read_json_checked,
    write_bytes,
    write_json,
    write_text,
)

CONFIG = "config.json"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
TRACE = "trace.json"
DRIFT = "drift.json"
PLAN = "plan.json"
CHECKPOINT = "checkpoint.pt"
SHARDS = "checkpoint-shards"
KEPT = "checkpoints"  # --keep-last/--keep-best: RUN/checkpoints/step-N/ (train/checkpoint/kept.py)
KEPT_INDEX = "kept.json"  # RUN/checkpoints/kept.json: which are the last N and the best
LOCK = "gradsync.lock"
MARKER = "gradsync-run.json"  # {"format": RUN_FORMAT}: gradsync may write here (ownership.py)
RUN_FORMAT = "gradsync-run"
REPORT = "report.html"
BASELINE = "baseline"
# --log trackers (train/records/trackers/): each library's own files, and the run ids they resume
TRACKERS = "trackers.json"
TENSORBOARD_DIR = "tb"
METRICS_CSV = "metrics.csv"
WANDB_DIR = "wandb"  # wandb.init(dir=RUN) writes RUN/wandb/
MLFLOW_DIR = "mlruns"


def _drop_none(d: dict, keep: tuple[str, ...]) -> dict:
    return {k: v for k, v in d.items() if v is not None or k in keep}


@dataclass
class StepRecord:
    """One line of ``metrics.jsonl``: what one optimizer step did (rank 0 writes it).

    ``loss`` is the exact mean over every item of the global batch (summed over
    ranks and micro-steps, divided by the global item count); ``eval_loss`` the
    same over the whole held-out set, on the steps where it was evaluated.
    Times are rank 0's; ``*_by_rank`` lists hold every rank's figure.
    """

    step: int
    loss: float | None
    lr: float
    items: int
    world_size: int
    grad_norm: float | None = None
    skipped: bool = False  # the update was not applied (non-finite, or overflow below)
    overflow: bool | None = None  # fp16: skipped because the gradient overflowed its loss scale
    loss_scale: float | None = None  # fp16: the loss scale this step's backward ran with
    eval_loss: float | None = None
    eval_metrics: dict[str, float] | None = None  # TrainData.metrics, beside eval_loss
    time_s: float = 0.0
    unix_time: float = 0.0
    step_time_s: float = 0.0
    compute_s: float = 0.0
    exposed_comm_s: float = 0.0
    exposed_comm_s_by_rank: list[float] = field(default_factory=list)
    comm_bytes: int = 0
    collectives: int = 0
    peak_mem_mb_by_rank: list[float] = field(default_factory=list)
    samples_per_s: float = 0.0
    tokens_per_s: float | None = None
    scaling_efficiency: float | None = None
    sent_bytes: int | None = None  # this rank on the wire, when the strategy counts it
    grad_cosine: float | None = None  # compressed vs exact gradient, on probed steps
    grad_rel_error: float | None = None
    grad_steps: list[int] | None = None  # --compress-delay: the steps whose gradients it applied
    one_model: bool | None = None  # local updates: every replica holds the same model now
    share_by_rank: list[int] = field(default_factory=list)  # samples each rank took
    busy_s_by_rank: list[float] = field(default_factory=list)  # compute: step minus blocked
    balance_saved_s: float | None = None  # vs the even split, from this step's rates
    # across replica groups (--ft-group): the groups whose gradients the step summed, the
    # attempts it took, seconds lost in failed ones, seconds its quorum took, healed here
    quorum: list[int] | None = None
    attempts: int | None = None
    lost_s: float | None = None
    quorum_s: float | None = None
    healed: bool | None = None
    host_reads: int | None = None  # GRADSYNC_HOST_READS=1: device values read (observe/host_reads)

    def to_json(self) -> dict:
        return _drop_none(asdict(self), keep=("loss", "grad_norm"))


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _whole(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _list_of(check):
    return lambda v: isinstance(v, list) and all(check(x) for x in v)


# a kind in StepRecord's and Summary's annotations -> its check (a field itself may be
# null: a non-finite float is written so; an element of a list may not)
_KINDS = {"int": _whole, "float": _number, "bool": lambda v: isinstance(v, bool),
          "str": lambda v: isinstance(v, str), "dict": lambda v: isinstance(v, dict),
          "list[float]": _list_of(_number), "list[int]": _list_of(_whole),
          "dict[str, float]": lambda v: isinstance(v, dict) and all(
              isinstance(k, str) and (x is None or _number(x)) for k, x in v.items())}
_WORDS = {"int": "a whole number", "float": "a number", "bool": "true or false",
          "str": "a string", "dict": "a table", "list[float]": "a list of numbers",
          "list[int]": "a list of whole numbers", "dict[str, float]": "a table of numbers"}


def _failures(v) -> bool:
    return isinstance(v, list) and all(isinstance(f, dict) and _whole(f.get("rank"))
                                       and isinstance(f.get("how", ""), str) for f in v)


RESTART_FIELDS = {"event": "str", "step": "int", "attempt": "int", "max_restarts": "int",
                  "reached_step": "int", "world_size": "int", "unix_time": "float",
                  "failed": "failures"}
"""A ``{"event": "restart", ...}`` record's fields and their kinds (``train/checkpoint/restarts.py``
writes it; ``failed``: [{"rank", "how", "exitcode", "signal", "unix_time"}])."""
_EVENT_KINDS = {**_KINDS, "failures": _failures}
_EVENT_WORDS = {**_WORDS, "failures": "a list of failures by rank"}
_STEP_FIELDS = {f.name: str(f.type) for f in fields(StepRecord)}


def _shown(v) -> str:
    text = repr(v)
    return text if len(text) <= 30 else text[:27] + "..."


def record_problem(rec: dict) -> str | None:
    """What makes ``rec`` (one decoded line of ``metrics.jsonl``) unusable, or None.

    A step record needs a whole-number ``step`` >= 0; every field :class:`StepRecord`
    declares must be of its kind (a number field may be null: a non-finite value is
    written so); fields it does not declare are not judged. An event record's known
    fields likewise (:data:`RESTART_FIELDS`)."""
    if "event" in rec:
        table, kinds, words = RESTART_FIELDS, _EVENT_KINDS, _EVENT_WORDS
    else:
        if "step" not in rec:
            return "not a step record (it has no 'step')"
        if not _whole(rec["step"]) or rec["step"] < 0:
            return f"not a step record (its 'step' is {_shown(rec['step'])}, not a step number)"
        table, kinds, words = _STEP_FIELDS, _KINDS, _WORDS
    return fields_problem(rec, table, kinds, words)


def fields_problem(obj: dict, table: dict[str, str], kinds=None, words=None) -> str | None:
    """The first field of ``obj`` that ``table`` (name -> annotation) declares and whose
    value is of none of its kinds, in words; None when every one fits."""
    kinds, words = kinds or _KINDS, words or _WORDS
    for name, value in obj.items():
        kind = table.get(name)
        if kind is None or value is None:
            continue
        options = [k.strip() for k in kind.split("|") if k.strip() != "None"]
        if not any(kinds[k](value) for k in options):
            return f"its {name!r} is {_shown(value)}, not {words[options[0]]}"
    return None


def read_metrics_file(path: str) -> MetricsFile:
    """``metrics.jsonl`` as :class:`~gradsync.runfiles.MetricsFile`: whole lines of
    usable records, a note for each line dropped (:func:`record_problem`)."""
    return runfiles.read_metrics_file(path, record_problem)


def read_metrics(path: str) -> tuple[list[dict], int]:
    """(step records, lines dropped); dropped = -1 when the file does not exist."""
    return runfiles.read_metrics(path, record_problem)


def rewrite_metrics(path: str, last_step: int) -> tuple[int, list[str]]:
    """Keep the usable records (and events) of steps ``<= last_step``, atomically
    (:func:`gradsync.runfiles.rewrite_metrics`)."""
    return runfiles.rewrite_metrics(path, last_step, record_problem)


def truncate_metrics(path: str, last_step: int) -> int:
    return runfiles.truncate_metrics(path, last_step, record_problem)


@dataclass
class Summary:
    """``summary.json``: written once, when the last step is done (its presence = finished)."""

    model: str
    data: str
    strategy: str
    precision: str
    optimizer: str
    seed: int
    steps: int
    world_size: int
    accumulation: int
    global_batch: int
    micro_batch: int
    final_loss: float | None
    final_eval_loss: float | None
    resumed_from: int
    world_sizes: list[int]
    median_step_s: float | None
    samples_per_s: float | None
    tokens_per_s: float | None
    train_wall_s: float
    total_wall_s: float
    checkpoint: str
    buckets: int
    bucket_cap_mb: float | None
    skipped_steps: list[int]  # non-finite steps skipped (--on-nonfinite skip-step)
    memory: dict | None
    drift: dict | None
    traced_steps: list[int] | None
    autotune: dict | None
    baseline_samples_per_s: float | None = None
    scaling_efficiency: float | None = None
    # what the exact all-reduce would send: per bucket, or the whole gradient when not
    # bucketed; and rank 0's totals over the run (definitions: observe/traffic.py)
    gradient_bytes: list[int] | None = None
    sent_bytes: int | None = None
    exact_bytes: int | None = None
    collectives: str | None = None  # what --collectives auto chose (Strategy.collectives)
    # across replica groups (--ft-group): this group's failures, heals and seconds lost
    fault_tolerance: dict | None = None
    # fp16: {"skipped": steps skipped by loss scaling over the whole run, "scale": at the end}
    loss_scale: dict | None = None
    # --keep-last/--keep-best: {"last": [steps], "best": {"step", "metric", "value"} | None,
    # "dir": RUN/checkpoints}; --early-stop: {"monitor", "mode", "patience", "min_delta",
    # "stopped_at" (None: not triggered), "best", "best_step", ...} (train/step/monitor.py)
    kept: dict | None = None
    early_stop: dict | None = None

    def to_json(self) -> dict:
        return clean(asdict(self))

    @classmethod
    def problem(cls, d: dict) -> str | None:
        """A field of a decoded summary.json that is not of its kind, in words, or None."""
        return fields_problem(d, {f.name: str(f.type) for f in fields(cls)})

    @classmethod
    def from_json(cls, d: dict) -> Summary:
        """Tolerant: unknown keys are ignored, missing ones become None."""
        names = {f.name for f in fields(cls)}
        return cls(**{n: d.get(n) for n in names})


def collectives_text(asked: str, chosen: str | None) -> str:
    """``--collectives`` in words: what ``auto`` chose (``chosen``, from summary.json) or
    the flag's value; empty for a plain native run."""
    if asked == "auto":
        return f"{chosen} collectives (auto)" if chosen else "collectives chosen by auto"
    return "" if asked == "native" else f"{asked} collectives"


DTYPE_SHORT = {"float64": "fp64", "float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def precision_text(config: dict) -> str:
    """How the run computed, as its tables name it: ``--precision``, where ``fp32`` -- the
    model's own dtype -- is named by that dtype (config.json's ``param_dtype``): a float64
    model trains in fp64, and calling it fp32 was wrong (issue 37)."""
    precision = config.get("precision") or "fp32"
    if precision == "fp32":
        return DTYPE_SHORT.get(config.get("param_dtype"), precision)
    return precision


def strategy_text(config: dict) -> str:
    """The run's method by name: the local-update method (``diloco``, ``streaming-diloco``)
    where one replaced the gradient sync, else ``--strategy``. A DiLoCo run's
    ``--strategy`` is ddp's default, which its title used to show (issue 37)."""
    sync = config.get("sync") or "exact"
    return sync if sync in ("diloco", "streaming-diloco") else config.get("strategy") or "ddp"


def sync_description(config: dict, chosen: str | None = None) -> str:
    """How a run synchronised, in words, from its config (train's table and the report);
    ``chosen``: the collectives ``--collectives auto`` resolved to, where known."""
    method = config.get("sync", "exact")
    compress = config.get("compress", "none")
    asked = config.get("collectives", "native")
    how = collectives_text(asked, chosen)
    two_level = (chosen if asked == "auto" else asked) == "hierarchical"
    if method == "exact":
        if compress == "none":
            return "exact" + (f", {how}" if how else "")
        where = " across hosts, exact inside each" if two_level else ""
        return f"{compress}-compressed gradients{where}" + (f", {how}" if how else "") \
            + " (not exact)"
    text = (f"{'streaming ' if method == 'streaming-diloco' else ''}DiLoCo, "
            f"H={config.get('sync_every')}")
    if method == "streaming-diloco":
        text += (f", F={config.get('fragments')}, tau={config.get('sync_delay')}, "
                 f"alpha={config.get('sync_alpha')}")
    text += f", outer SGD lr {config.get('outer_lr')} momentum {config.get('outer_momentum')}"
    if compress != "none":
        text += f", {compress} pseudo-gradients"
    if two_level:
        text += ", a worker per host"
    return text + " (not exact)"

"""The run directory: the one home of its file names and of what its files hold.

``gradsync train`` (``train/``) writes a run directory and ``gradsync report``
(``observe/``) reads it; both take the names and the record schemas from here,
so a field renamed on one side cannot silently vanish on the other. Torch-free:
the report and the planner import it without pulling in the engine.

JSON written here is always valid JSON: a NaN or infinite float (a diverged
loss, a step time that was never measured) is written as ``null``, because
Python's ``json`` would otherwise emit the bare token ``NaN`` that other readers
(browsers, ``jq``) refuse.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, fields

CONFIG = "config.json"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
TRACE = "trace.json"
DRIFT = "drift.json"
PLAN = "plan.json"
CHECKPOINT = "checkpoint.pt"
SHARDS = "checkpoint-shards"
LOCK = "gradsync.lock"
REPORT = "report.html"
BASELINE = "baseline"
TMP_PREFIX = ".tmp-"


def clean(obj):
    """``obj`` with every non-finite float replaced by None (recursively)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean(v) for v in obj]
    return obj


def dumps(obj, indent: int | None = None) -> str:
    return json.dumps(clean(obj), indent=indent, allow_nan=False)


def write_json(path: str, obj, indent: int = 2) -> None:
    """Write ``obj`` as valid JSON, atomically (readers see the old file or the new)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(dumps(obj, indent=indent))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def read_json(path: str):
    """The parsed file; None if absent; False if present but unreadable."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return False


def read_metrics(path: str) -> tuple[list[dict], int]:
    """(records, torn lines skipped); torn = -1 when the file does not exist."""
    rows, bad = [], 0
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    bad += 1
    except FileNotFoundError:
        return [], -1
    return rows, bad


def truncate_metrics(path: str, last_step: int) -> int:
    """Keep the records of steps ``<= last_step`` (a resume continues from there).

    Steps after the checkpoint were computed by an attempt whose state was lost;
    the resumed run computes them again, so keeping both would show every such
    step twice and draw curves that loop backwards. Torn lines go too. Returns
    the number of records removed. Atomic: a crash leaves the old file or the new.
    """
    rows, bad = read_metrics(path)
    if bad == -1:
        return 0
    keep = [r for r in rows if isinstance(r.get("step"), int) and r["step"] <= last_step]
    removed = len(rows) - len(keep)
    if removed == 0 and bad == 0:
        return 0
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        for r in keep:
            f.write(dumps(r) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return removed


class MetricsWriter:
    """Appends one StepRecord per line to ``metrics.jsonl`` (line-buffered: a crash
    loses at most the line being written, which readers skip as torn)."""

    def __init__(self, path: str):
        self._f = open(path, "a", buffering=1, encoding="utf-8")

    def write(self, record: StepRecord | dict) -> None:
        rec = record.to_json() if isinstance(record, StepRecord) else record
        self._f.write(dumps(rec) + "\n")

    def close(self) -> None:
        self._f.close()


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
    skipped: bool = False
    eval_loss: float | None = None
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

    def to_json(self) -> dict:
        return _drop_none(asdict(self), keep=("loss", "grad_norm"))


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
    skipped_steps: list[int]
    memory: dict | None
    drift: dict | None
    traced_steps: list[int] | None
    autotune: dict | None
    baseline_samples_per_s: float | None = None
    scaling_efficiency: float | None = None

    def to_json(self) -> dict:
        return clean(asdict(self))

    @classmethod
    def from_json(cls, d: dict) -> Summary:
        """Tolerant: unknown keys are ignored, missing ones become None."""
        names = {f.name for f in fields(cls)}
        return cls(**{n: d.get(n) for n in names})


def sync_description(config: dict) -> str:
    """How a run synchronised, in words, from its config (train's table and the report)."""
    method = config.get("sync", "exact")
    compress = config.get("compress", "none")
    if method == "exact":
        text = "exact"
        if config.get("collectives", "native") != "native":
            text += f", {config['collectives']} collectives"
        if compress != "none":
            text = f"{compress}-compressed gradients (not exact)"
        return text
    text = (f"{'streaming ' if method == 'streaming-diloco' else ''}DiLoCo, "
            f"H={config.get('sync_every')}")
    if method == "streaming-diloco":
        text += (f", F={config.get('fragments')}, tau={config.get('sync_delay')}, "
                 f"alpha={config.get('sync_alpha')}")
    text += f", outer SGD lr {config.get('outer_lr')} momentum {config.get('outer_momentum')}"
    if compress != "none":
        text += f", {compress} pseudo-gradients"
    return text + " (not exact)"

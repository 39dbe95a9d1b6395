"""What `gradsync train` measures besides the loss: step figures, the trace, drift.

Kept out of the loop so the loop reads as training. Every rank measures its own
step (time blocked on collectives, bytes, peak memory); the figures travel in
the one statistics all-gather the step needs anyway -- before the optimizer
update, because it also carries every rank's loss sum and item count (the exact
global mean loss) and gradient norm, which decide on every rank alike whether the
update may happen (a NaN stops or skips it). So measuring adds no collective.
The tracer records only inside the ``--trace-steps`` window; its spans are
gathered to rank 0 once, when the window closes, and written as one Chrome
trace. The drift check runs every ``--drift-every`` steps and at the end; its
result is kept in the run directory (drift.json) so the report can show it even
when it failed.
"""

from __future__ import annotations

import math
import os
import time

import torch

from ...engine.local.streaming import StreamingDiLoCo
from ...engine.strategy.inexact import LocalUpdateStrategy
from ...engine.sync.drift import check_replicas
from ...engine.transport import comm, host
from ...engine.transport.tracing import Tracer
from ...errors import ReplicaMismatchError
from ...observe.chrome import rank_payload, write_trace
from ...observe.metrics import StepMeter, peak_memory_bytes
from ...rundir import BASELINE, DRIFT, PLAN, SUMMARY, TRACE, read_json, write_json
from ..config.run_config import RunConfig

STATS = ("loss_sum", "items", "grad_norm", "exposed_s", "bytes", "peak_memory", "samples",
         "busy_s")


class Instruments:
    def __init__(self, cfg: RunConfig, rank: int, world: int, device: torch.device):
        self.cfg, self.rank, self.world, self.device = cfg, rank, world, device
        self.meter = StepMeter()
        self.window = cfg.observe.trace_window
        self.tracer = Tracer(rank) if self.window else None
        self.tracing = False
        # "at": where replicas are expected identical -- "steps" (every N steps and the
        # end), "syncs" (local updates: after each sync), "end" (streaming: the final sync)
        at = {"diloco": "syncs", "streaming-diloco": "end"}.get(cfg.sync.method, "steps")
        self.drift = {"checks": 0, "ok": True, "every": cfg.observe.drift_every,
                      "last_step": None, "at": at, "steps": []}
        self._local_checked: tuple[int, int] | None = None  # (step, inner step) last checked

    # ---------------------------------------------------------------- per step
    def begin_step(self, step: int) -> None:
        """``step`` is 1-based, as in metrics.jsonl."""
        self.meter.reset()
        w = self.window
        if self.tracer is not None and w[0] <= step <= w[1]:
            if not self.tracing:
                self.tracer.start()
                self.tracing = True
            self.tracer.begin_step(step)

    def busy_s(self, started: float) -> float:
        """Seconds since ``started`` (this step's start) not spent blocked in collectives."""
        return max(0.0, time.perf_counter() - started - self.meter.exposed_s)

    def gather_stats(self, loss_sum, items: float, grad_norm, samples: int,
                     busy_s: float) -> torch.Tensor:
        """[world, len(STATS)] float64 on the host: every rank's figures (see :data:`STATS`).

        ``loss_sum`` and ``grad_norm`` may be device tensors (the step keeps them there):
        they join the host's figures on the device, and the table is the step's one
        read. ``samples`` / ``busy_s``: this rank's share of the step and its own
        compute time, which the straggler balancer turns into a rate (data/balance.py).
        """
        host_part = torch.tensor([items, self.meter.exposed_s, float(self.meter.bytes),
                                  float(peak_memory_bytes(self.device)), float(samples), busy_s],
                                 dtype=torch.float64).to(self.device, non_blocking=True)
        f64 = {"dtype": torch.float64, "device": self.device}
        device_part = torch.stack([torch.as_tensor(loss_sum, **f64).reshape(()),
                                   torch.as_tensor(grad_norm, **f64).reshape(())])
        mine = torch.cat([device_part[:1], host_part[:1], device_part[1:], host_part[1:]])
        out = torch.empty(self.world * len(STATS), dtype=torch.float64, device=self.device)
        comm.all_gather_single(out, mine, tag="stats")
        return host.read(out).view(self.world, len(STATS))

    def end_step(self, step: int) -> None:
        if not self.tracing:
            return
        self.tracer.end_step()
        if step >= self.window[1] or step >= self.cfg.run.steps:
            self.tracer.stop()
            self.tracing = False
            self._write_trace()

    def _write_trace(self) -> None:
        gathered = comm.gather_object(rank_payload(self.tracer), dst=0, tag="trace")
        if self.rank == 0:
            write_trace(os.path.join(self.cfg.run.out, TRACE), gathered)

    def step_figures(self, rows: list[list[float]], step_s: float) -> dict:
        """The measured fields of this step's StepRecord (rank 0's times, every rank's
        lists), from :meth:`gather_stats`'s table as rows of numbers."""
        exposed = self.meter.exposed_s  # rank 0's, including the statistics gather
        return {
            "step_time_s": step_s,
            "compute_s": max(0.0, step_s - exposed),
            "exposed_comm_s": exposed,
            "exposed_comm_s_by_rank": [row[3] for row in rows],
            "comm_bytes": int(self.meter.bytes),
            "collectives": self.meter.collectives,
            "peak_mem_mb_by_rank": [row[5] / 2**20 for row in rows],
            "share_by_rank": [int(row[6]) for row in rows],
            "busy_s_by_rank": [row[7] for row in rows],
        }

    # ---------------------------------------------------------------- occasional
    def write_plan(self, strategy) -> None:
        """Rank 0: the parameters and the bucket plan in use now.

        Called after the first step (the one rebuild), when the trace window closes
        and at the end, so with ``--bucket-cap-mb auto`` it follows the tuned cap.
        """
        dp = strategy.model
        if self.rank != 0 or not strategy.bucket_plan or not hasattr(dp, "param_specs"):
            return
        write_json(os.path.join(self.cfg.run.out, PLAN), {
            "bucket_cap_mb": dp.bucket_cap_bytes / 2**20,
            "first_bucket_mb": dp.first_bucket_bytes / 2**20,
            "world_size": self.world,
            "params": [[p.name, p.numel, p.itemsize, p.dtype] for p in dp.param_specs],
            "buckets": [{"index": b.index, "params": list(b.params), "nbytes": b.nbytes}
                        for b in strategy.bucket_plan],
        }, indent=1)

    def maybe_check_drift(self, step: int, strategy, last: bool = False) -> None:
        """Replicas bit-identical *and* finite: identical NaNs are drift from the model too.

        Checked where the strategy makes the replicas identical (``--drift-every 0``:
        never): replicated ones every ``--drift-every`` steps and at the end. Local
        updates, whose replicas differ between syncs by design, right after a DiLoCo
        sync -- the first one, then the first at least ``--drift-every`` steps after
        the previous check (so never more often than that, and never between syncs)
        -- and at the end; streaming DiLoCo merges each synced fragment into the local
        copy, so its replicas agree only after the final sync, at the end. zero3,
        whose ranks hold different shards: never. ``strategy``: or a replicated module;
        ``last``: the run ends after this step (an early stop), checked as at the end.
        """
        if not self.cfg.observe.drift_every or not (self._drift_due(step, strategy) or (
                last and getattr(strategy, "replicated", True))):
            return
        module = strategy if isinstance(strategy, torch.nn.Module) else strategy.module
        try:
            n = check_replicas(module, step=step)
            bad = next((name for name, p in module.named_parameters()
                        if not bool(torch.isfinite(p.detach()).all())), None)
            if bad is not None:  # replicas agree, so every rank finds the same one
                raise ReplicaMismatchError(
                    f"parameter {bad!r} holds NaN or inf at step {step} (on every rank): "
                    "the run diverged; lower --lr")
        except ReplicaMismatchError as e:
            self.drift.update(ok=False, last_step=step, error=str(e))
            self._save_drift()
            raise
        steps = self.drift["steps"] + [step]
        self.drift.update(checks=len(steps), last_step=step, params=n, steps=steps)
        self._save_drift()

    def continue_drift(self, step: int) -> None:
        """A resumed run's checks before ``step`` (its checkpoint), from drift.json, so the
        count and the steps the report names are the run's, not this session's alone."""
        earlier = read_json(os.path.join(self.cfg.run.out, DRIFT))
        if not isinstance(earlier, dict) or earlier.get("ok") is not True:
            return
        steps = [s for s in earlier.get("steps") or [] if isinstance(s, int) and s <= step]
        if steps:
            self.drift.update(checks=len(steps), steps=steps, last_step=steps[-1])

    def _drift_due(self, step: int, strategy) -> bool:
        every = self.cfg.observe.drift_every
        if isinstance(strategy, LocalUpdateStrategy):
            diloco = strategy.diloco
            inner, last = diloco.steps, self._local_checked  # a skipped step: no inner step
            synced = (not isinstance(diloco, StreamingDiLoCo) and inner
                      and diloco.replicas_agree and (last is None or (
                          inner != last[1] and step - last[0] >= every)))
            if synced or step == self.cfg.run.steps:  # the last step ends with a sync
                self._local_checked = (step, inner)
                return True
            return False
        replicated = getattr(strategy, "replicated", True)
        return replicated and (step % every == 0 or step == self.cfg.run.steps)

    def _save_drift(self) -> None:
        if self.rank == 0:
            write_json(os.path.join(self.cfg.run.out, DRIFT), self.drift, indent=1)

    def close(self) -> None:
        if self.tracer is not None and self.tracing:
            self.tracer.stop()
        self.meter.close()


def finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


def baseline_rate_of(cfg: RunConfig) -> float | None:
    """Samples/s of the 1-worker baseline run in OUT/baseline, if one was run."""
    summary = read_json(os.path.join(cfg.run.out, BASELINE, SUMMARY))
    try:
        return float(summary["samples_per_s"])
    except (TypeError, KeyError, ValueError):
        return None


def write_report_safely(out: str) -> None:
    """The report is a convenience: a failure to draw it must not fail the run."""
    try:
        from ...observe.report import write_report

        result = write_report(out)
        print(f"report: {result.html}", flush=True)
        for line in result.missing:
            print(f"report: missing: {line}", flush=True)
    except Exception as e:  # noqa: BLE001 - report the problem, keep the trained run
        print(f"gradsync train: warning: could not write the report: "
              f"{type(e).__name__}: {e}", flush=True)

"""SyncOptions: how a run synchronises, beside which strategy shards what.

``gradsync train --sync exact|diloco|streaming-diloco --sync-every H --fragments F
--compress none|bf16|fp16|powersgd:R|int8 --collectives auto|native|hierarchical|ring|tree|server``
maps one-to-one onto these fields. ``exact`` (the default) is gradsync's exact
synchronous data parallelism; everything else spends exactness on purpose for
slow links: compression (arXiv 1905.13336 for PowerSGD), local updates (DiLoCo,
arXiv 2311.08105; Streaming DiLoCo, arXiv 2501.18512).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from ...errors import UsageError
from ..transport.algorithms.topology import hosts_in_env

SYNC_METHODS = ("exact", "diloco", "streaming-diloco")
COLLECTIVES = ("auto", "native", "hierarchical", "ring", "tree", "server")
COMPRESSIBLE = ("auto", "native", "hierarchical")  # a compressor composes with these


def auto_collectives(env=None, group=None) -> str:
    """What ``--collectives auto`` means for this job: ``hierarchical`` when torchrun
    reports more than one host with more than one rank on each, else ``native``.

    Both are exact; the two-level sum only pays where a slow link joins hosts of
    several ranks (one rank per host: it is a flat ring; one host: no slow link).
    Decided from each rank's own environment (``hosts_in_env``), so every rank
    decides alike without a collective. ``group``: a process group other than the
    world's gets ``native`` (the two-level groups are built over the world).
    """
    hosts = hosts_in_env(os.environ if env is None else env)
    if group is not None or hosts is None:
        return "native"
    return "hierarchical" if hosts[0] > 1 and hosts[1] > 1 else "native"


@dataclass(frozen=True)
class SyncOptions:
    """How gradients (or parameter deltas) travel.

    method: ``exact`` | ``diloco`` | ``streaming-diloco``.
    every: H, inner steps between syncs (local-update methods).
    fragments: F, fragments of streaming DiLoCo (synced at staggered steps).
    delay: tau, inner steps a streaming fragment's result takes to be applied.
    alpha: weight of the local parameters when a streaming fragment is merged.
    outer_lr, outer_momentum: the outer SGD (Nesterov when momentum > 0; DiLoCo's
        0.7 and 0.9; lr 1 and no momentum is Local SGD).
    compress: ``none`` | ``bf16`` | ``fp16`` | ``powersgd:R`` | ``int8`` (exact: the
        gradient buckets; local updates: the pseudo-gradient, bf16/fp16/int8 only).
    collectives: ``auto`` (the default: ``hierarchical`` on several hosts of several
        ranks, else ``native``; see :func:`auto_collectives` and :meth:`resolved`),
        ``native`` (the backend's), or ``hierarchical`` (two-level: hosts joined by a
        slow link; with ``compress`` exact inside a host and compressed across hosts;
        stage 3 becomes hybrid sharding; local updates get a worker per host, exact
        inside it), ``ring``, ``tree``, ``server`` (reference algorithms).
    probe_every: with compression, every this many steps also sum the exact gradient
        once and record how far the compressed one is (cosine, relative error).
    compress_delay: with compression, 0 (the default) or 1: apply each step's
        compressed sum one step late, its communication overlapped with the next step
        (``compress/delayed.py``; opt-in, since it changes the trajectory).
    warmup, momentum_warmup, every_max: local updates (``local/diloco.py``, ``SyncSchedule``):
        W synchronous steps first (post-local SGD), the outer momentum ramped over K
        outer steps, and H grown up to M as the learning rate decays (diloco only);
        0 turns each off. eager: streaming-diloco's eager updates (``engine/local/streaming.py``).
    """

    method: str = "exact"
    every: int = 25
    fragments: int = 2
    delay: int = 1
    alpha: float = 0.5
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    compress: str = "none"
    collectives: str = "auto"
    probe_every: int = 25
    compress_delay: int = 0
    warmup: int = 0
    momentum_warmup: int = 0
    every_max: int = 0
    eager: bool = False

    def __post_init__(self) -> None:
        self._check_local_schedule()
        if self.method not in SYNC_METHODS:
            raise UsageError(f"--sync must be one of {', '.join(SYNC_METHODS)}, "
                             f"got {self.method!r}")
        if self.collectives not in COLLECTIVES:
            raise UsageError(f"--collectives must be one of {', '.join(COLLECTIVES)}, "
                             f"got {self.collectives!r}")
        for name in ("every", "fragments"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise UsageError(f"--{'sync-every' if name == 'every' else name} must be an "
                                 f"integer >= 1, got {getattr(self, name)!r}")
        if not isinstance(self.delay, int) or self.delay < 0:
            raise UsageError(f"--sync-delay must be an integer >= 0, got {self.delay!r}")
        if self.probe_every < 0:
            raise UsageError(f"--probe-every must be >= 0, got {self.probe_every!r}")
        if self.compress_delay not in (0, 1) or isinstance(self.compress_delay, bool):
            raise UsageError(f"--compress-delay must be 0 or 1, got {self.compress_delay!r}")
        if self.compress_delay and (self.compress == "none" or self.method != "exact"):
            raise UsageError(f"--compress-delay {self.compress_delay} delays compressed gradient "
                             "sums: it needs --compress (bf16, fp16, int8, powersgd:R) with "
                             "--sync exact")
        if not 0 <= self.alpha < 1:
            raise UsageError(f"--sync-alpha must be in [0, 1), got {self.alpha!r}")
        if not self.outer_lr > 0 or not 0 <= self.outer_momentum < 1:
            raise UsageError(f"--outer-lr must be > 0 and --outer-momentum in [0, 1), got "
                             f"{self.outer_lr!r} and {self.outer_momentum!r}")
        local = self.method != "exact"
        if local and self.compress.split(":")[0] == "powersgd":
            raise UsageError("--compress powersgd compresses gradient buckets; local-update "
                             "methods send pseudo-gradients as bf16, fp16 or int8")
        if local and self.collectives not in COMPRESSIBLE:
            raise UsageError(f"--collectives {self.collectives} needs --sync exact (local "
                             "updates take native, or hierarchical: a worker per host)")
        if self.compress != "none" and self.collectives not in COMPRESSIBLE:
            raise UsageError(f"--compress and --collectives {self.collectives} do not combine: "
                             "a compressor composes with native or hierarchical only")
        if local and self.compress != "none" and self.collectives == "hierarchical":
            raise UsageError(f"--sync {self.method} --collectives hierarchical sends "
                             "pseudo-gradients between hosts exactly (a worker per host); "
                             "drop --compress, or drop --collectives for a worker per rank")

    def _check_local_schedule(self) -> None:
        """--sync-warmup, --outer-momentum-warmup, --sync-every-max (the engine checks the
        same; here so a bad value fails before any worker starts)."""
        for name, flag in (("warmup", "--sync-warmup"),
                           ("momentum_warmup", "--outer-momentum-warmup"),
                           ("every_max", "--sync-every-max")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise UsageError(f"{flag} must be an integer >= 0, got {value!r}")
        if self.every_max and self.method != "exact" and isinstance(self.every, int) \
                and self.every_max < self.every:
            raise UsageError(f"--sync-every-max ({self.every_max}) must be 0 (H fixed) or at "
                             f"least --sync-every ({self.every})")
        if self.every_max and self.method == "streaming-diloco":
            raise UsageError("--sync-every-max needs --sync diloco: streaming-diloco's "
                             "staggered fragments assume one fixed --sync-every")
        if self.eager and self.method == "streaming-diloco" and self.delay == 0:
            raise UsageError("--sync-eager stands in for a sum still in flight: it needs "
                             "--sync-delay >= 1 (with 0 the sum is applied at once)")

    def resolved(self, group=None, env=None) -> SyncOptions:
        """These options with ``collectives="auto"`` decided (:func:`auto_collectives`).

        ``auto`` never changes what a run computes or holds, only how an exact sum
        travels: so ``--sync diloco`` (hierarchical would make a worker of each host)
        and zero3 (it would become hybrid sharding, more memory per rank) get
        ``native``; ask for ``hierarchical`` by name for those.
        """
        if self.collectives != "auto":
            return self
        choice = auto_collectives(env, group) if self.method == "exact" else "native"
        return dataclasses.replace(self, collectives=choice)

    def check_precision(self, precision: str) -> None:
        """Local updates and compressors handle gradients in fp32 only (checked by the
        strategy builders, and by ``gradsync train`` before any worker starts)."""
        if precision == "fp32":
            return
        if self.method != "exact":
            raise UsageError(f"--sync {self.method} trains in fp32 (the global copy and the "
                             "pseudo-gradients are kept in full precision); drop --precision")
        if self.compress != "none":
            raise UsageError(f"--compress {self.compress} and --precision {precision} do not "
                             f"combine: the compressor takes over the gradient reduction that "
                             f"--precision {precision} keeps in fp32; use one or the other")

    @property
    def exact(self) -> bool:
        return self.method == "exact" and self.compress == "none"

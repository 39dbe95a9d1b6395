"""What ``--ft-groups`` / ``--ft-group`` accept, checked before anything starts.

Fault-tolerant runs carry ddp and ZeRO stages 1-3 inside a group and sum exactly
across groups (each rank sums the slice it owns; a healing rank loads its own
shard without a collective, since torchft heals some ranks of a group and not
others), and ``--sync diloco`` or ``streaming-diloco`` with one DiLoCo worker per group
(``local_groups.py``; streaming's fragment sums are taken at their sync step through the
quorum and kept aside until applied, the plain run's trajectory without its overlap).
What they do not carry yet is refused in one line rather than silently dropped:
compression across the quorum (its error-feedback state is per rank, and a
healing rank would need its peer's), the speed balancer (the quorum deals each
step's batch) and the reference collectives.
"""

from __future__ import annotations

from ..errors import UsageError


def check_ft(cfg) -> None:
    """Refuse flag combinations a fault-tolerant run cannot honour, naming the flag."""
    if not isinstance(cfg.ft_groups, int) or cfg.ft_groups < 0:
        raise UsageError(f"--ft-groups must be an integer >= 0, got {cfg.ft_groups!r}")
    if cfg.ft_group != -1 and not cfg.ft_groups:
        raise UsageError("--ft-group needs --ft-groups N, the number of replica groups")
    if cfg.ft_groups and not -1 <= cfg.ft_group < cfg.ft_groups:
        raise UsageError(f"--ft-group must be in 0..{cfg.ft_groups - 1} for --ft-groups "
                         f"{cfg.ft_groups}, got {cfg.ft_group}")
    if not cfg.ft_timeout > 0:
        raise UsageError(f"--ft-timeout must be > 0, got {cfg.ft_timeout!r}")
    if not cfg.ft_groups:
        return
    refused = [(cfg.strategy not in ("ddp", "zero1", "zero2", "zero3"),
                f"--strategy {cfg.strategy}"),
               (cfg.compress != "none", f"--compress {cfg.compress}"),
               (cfg.balance != "off", f"--balance {cfg.balance}"),
               # fp16's overflow verdict is taken inside each group, before the groups' sum
               (cfg.precision == "fp16", "--precision fp16"),
               (cfg.baseline, "--baseline"),
               (cfg.collectives not in ("native", "auto"), f"--collectives {cfg.collectives}")]
    for bad, flag in refused:
        if bad:
            raise UsageError(f"{flag} does not combine with --ft-groups yet: across replica "
                             "groups gradsync sums the exact gradient of --strategy ddp or "
                             "zero1-3 (--sync exact, diloco or streaming-diloco, --precision "
                             "fp32 or bf16, --compress none, --balance off, --collectives "
                             "native or auto); see docs/fault_tolerance.md")
    for name in ("sync_warmup", "outer_momentum_warmup", "sync_every_max", "sync_eager"):
        if getattr(cfg, name):  # a group's outer syncs are due every --sync-every (local_groups.py)
            raise UsageError(f"--{name.replace('_', '-')} {getattr(cfg, name)} does not combine "
                             "with --ft-groups yet: across replica groups the outer sync comes "
                             "every --sync-every steps through the quorum, from the first step")
    if cfg.ft_group == -1 and cfg.global_batch < cfg.ft_groups * cfg.workers:
        raise UsageError(f"--global-batch {cfg.global_batch} is smaller than --ft-groups "
                         f"{cfg.ft_groups} x --workers {cfg.workers}: every worker needs a sample")

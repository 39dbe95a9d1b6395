"""What ``--data-parts P`` (non-IID data, ``data/parted_sampler.py``) accepts, and what it refuses.

Checked before anything starts, each refusal one line naming the numbers or the flag:

* ``P`` must divide ``--global-batch`` (every part gives ``B/P`` samples a step) and the
  number of workers ``K`` (every block of ``K/P`` workers reads one part). ``K`` is known
  to ``gradsync train`` before it launches (``--workers``) and to rank 0 of a worker
  group under torchrun: ``config/plan.py`` checks it where the world is known, through
  the sampler's own check (``data/parted_sampler.check_parts``); a run resumed on another
  ``K`` is held to it too (the per-part positions are global, so any multiple of ``P``
  continues exactly).
* ``--balance auto`` is refused: it moves samples from a slow worker to a fast one, and
  with parts a worker's samples must come from its own part; balancing inside a block
  would be possible but is not built.
* ``--ft-groups`` is refused: the quorum deals each step's batch over whichever groups
  are alive (``ft/shares.py``), which cannot keep a part on its own block.
* ``--straggler`` is accepted: it only slows a worker, whose share stays its own.
* ``--sync diloco|streaming-diloco`` and ``--compress`` are accepted: the sampler only
  decides which samples a worker reads. With ``--collectives hierarchical`` and ``P`` =
  number of hosts, each DiLoCo worker (a host) trains on its own part.
"""

from __future__ import annotations

from ...errors import UsageError


def check_data_parts(cfg) -> None:
    """The checks that need no number of workers (``resolve.resolve``)."""
    parts = cfg.data_parts
    if not isinstance(parts, int) or parts < 1:
        raise UsageError(f"--data-parts must be an integer >= 1, got {parts!r}")
    if parts == 1:
        return
    if cfg.global_batch % parts:
        raise UsageError(f"--data-parts {parts} must divide --global-batch "
                         f"({cfg.global_batch}): every part gives an equal share of each step")
    for bad, flag, why in (
            (cfg.balance != "off", f"--balance {cfg.balance}",
             "balancing moves samples between workers, and with parts a worker's samples "
             "must come from its own part"),
            (cfg.ft_groups, f"--ft-groups {cfg.ft_groups}",
             "the quorum deals each step over the groups alive, which cannot keep a part "
             "on its own workers")):
        if bad:
            raise UsageError(f"{flag} does not combine with --data-parts {parts}: {why}")

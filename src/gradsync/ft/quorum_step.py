"""`gradsync train` across replica groups (``--ft-group``): the loop's side of the quorum.

The loop asks three things of this file, and knows nothing else of torchft:

* :func:`attach` builds this rank's :class:`~gradsync.ft.replica.ReplicaGroup`,
  with what a healing peer receives: this rank's part of model and optimizer
  (``ft/transfer.py``), the schedule, the sampler's global position and the
  skipped steps;
* :func:`share` deals the step's global batch over the quorum's ranks and cuts
  this rank's part into micro-batches of at most ``--micro-batch``;
* :func:`reduce` replaces the group's gradient by the quorum's exact mean
  (``ft/cross_reduce.py``) and returns the quorum's item count and loss sum.

The step itself (``train/step/train_step.py``) then commits or redoes, and the loop
(``train/worker/loop.py``) asks :meth:`ReplicaGroup.begin` for each step's quorum.
"""

from __future__ import annotations

import os

from .. import dist as gdist
from .cross_reduce import QuorumSums, cross_reduce
from .replica import ReplicaGroup, lighthouse_address
from .shares import micro_split, quorum_share
from .transfer import load_local_state, local_state

BARRIER_ENV = "GRADSYNC_FT_BARRIER"  # set by the one-machine launcher (cli/train_groups.py)


def attach(sess) -> ReplicaGroup:
    """Join the replica groups: the lighthouse's quorum decides every step from now on
    (with ``--sync diloco``: every sync, ``local_groups.py``)."""
    cfg = sess.cfg
    if cfg.sync.method != "exact":
        from .local_groups import attach_local

        return attach_local(sess, os.environ.get(BARRIER_ENV))

    def state_fn() -> dict:
        return {"strategy": local_state(sess.strategy), "sched": sess.sched.state_dict(),
                "sampler": sess.sampler.state_dict(), "skipped": list(sess.skipped)}

    def load_fn(state: dict) -> None:
        sess.faults.at_heal(sess.rank, group.manager.current_step() + 1)
        load_local_state(sess.strategy, state["strategy"])
        sess.sched.load_state_dict(state["sched"])
        sess.sampler.load_state_dict(state["sampler"])
        sess.skipped[:] = state["skipped"]

    group = ReplicaGroup(cfg.ft.group, cfg.ft.groups, lighthouse_address(cfg.ft.lighthouse),
                         sess.rank, sess.world, state_fn, load_fn, sess.start_step,
                         timeout_s=cfg.ft.timeout, quorum_timeout_s=cfg.run.timeout)
    barrier = os.environ.get(BARRIER_ENV)
    if barrier and sess.start_step == 0 and not gdist.restart_count():
        group.wait_for_all(barrier, cfg.run.timeout)  # a fresh job: every group in the first quorum
    return group


def share(sess, block: list[int]) -> tuple[list[int], list[list[int]]]:
    """This rank's samples of ``block`` in this step's quorum, and its micro-batches."""
    if getattr(sess.ft, "local", False):
        from .local_groups import share as local_share

        return local_share(sess, block)
    q = sess.ft.current
    mine = quorum_share(block, q.size, q.position, sess.world, sess.rank)
    return mine, micro_split(mine, len(block), q.size * sess.world, sess.cfg.batch.micro_batch)


def reduce(sess, items: float, loss_sum: float) -> QuorumSums:
    """The quorum's exact mean gradient in place of the group's; the quorum's sums.
    None with ``--sync diloco``: an inner step's gradient stays inside the group."""
    if getattr(sess.ft, "local", False):
        return None
    sums = cross_reduce(sess.ft.manager, sess.strategy, items, loss_sum, sess.rank,
                        sess.world, sess.cfg.ft.group, sess.cfg.ft.groups)
    sess.ft.current.members = list(sums.members)
    sess.ft.current.sent_bytes = sums.sent_bytes
    return sums


def record(sess, report: dict) -> dict:
    """The step's quorum for its metrics line (members, attempts, seconds lost, healed),
    with the cross-group bytes added to the strategy's own ``sent_bytes``."""
    q = sess.ft.current
    return {**report, "sent_bytes": (report.get("sent_bytes") or 0) + q.sent_bytes,
            "quorum": list(q.members), "attempts": q.attempts, "lost_s": round(q.lost_s, 4),
            "quorum_s": round(q.quorum_s, 4), "healed": q.healed or None}


def announce(sess, q, committed: bool) -> None:
    """Rank 0's one line when the quorum changes, a step is redone or this group healed."""
    if not sess.display:
        return
    ft = sess.ft
    if not committed:
        sess.display.say(f"gradsync train: step {q.step} not committed ({ft.why_not}); taking "
                         "it again with the next quorum, on the same samples")
        return
    if q.healed:
        sess.display.say(f"gradsync train: healed at step {q.step}: model, optimizer, schedule "
                         f"and data position received from a live group ({q.quorum_s:.1f} s)")
    if ft.last_members is not None and q.members != ft.last_members:
        names = ", ".join(map(str, q.members))
        sess.display.say(f"gradsync train: from step {q.step} the quorum is group"
                         f"{'s' * (len(q.members) != 1)} {names} (was "
                         f"{', '.join(map(str, ft.last_members))})")
    ft.last_members = list(q.members)


def ft_figures(sess, rows: list[dict]) -> dict:
    """summary.json's ``fault_tolerance``: what this group went through, from its metrics
    (every committed step) and its ReplicaGroup (the attempts that did not commit)."""
    steps = [r for r in rows if "loss" in r and r.get("quorum") is not None]
    sizes: dict[str, int] = {}
    for r in steps:
        sizes[str(len(r["quorum"]))] = sizes.get(str(len(r["quorum"])), 0) + 1
    return {"group": sess.cfg.ft.group, "groups": sess.cfg.ft.groups,
            "redone_steps": sum(1 for r in steps if (r.get("attempts") or 1) > 1),
            "failed_attempts": sum((r.get("attempts") or 1) - 1 for r in steps),
            "heals": sum(1 for r in steps if r.get("healed")),
            "lost_s": round(sum(r.get("lost_s") or 0.0 for r in steps), 3),
            "quorum_s": round(sum(r.get("quorum_s") or 0.0 for r in steps), 3),
            "steps_by_quorum_size": sizes}


def ft_line(f: dict) -> str:
    """The closing table's line for ``fault_tolerance``."""
    sizes = ", ".join(f"{n} on {q}" for q, n in sorted(f["steps_by_quorum_size"].items()))
    return (f"group {f['group']} of {f['groups']}; steps by quorum size: {sizes or '-'}; "
            f"{f['redone_steps']} redone, {f['heals']} heal{'s' * (f['heals'] != 1)}, "
            f"{f['lost_s']:.1f} s lost")

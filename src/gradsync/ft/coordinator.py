"""What a step coordinator across replica groups tells, whichever way its steps go through a quorum.

``train/step/coordinator.py`` defines the interface the training step talks to (deal,
reduce, commit, and the step's record); across replica groups two implementations
follow it: ``quorum_step.py`` (a quorum every step, the exact sum across groups) and
``local_groups.py`` (a DiLoCo worker per group, a quorum at each sync). Both record a
step the same way -- the quorum it trained in, its attempts, the seconds lost and
waited, whether this group healed -- say the same lines when the quorum changes, and
give summary.json the same figures. That half lives here, once.

The coordinator holds the worker's session (``train/worker/session.py``) as an object:
healing restores its strategy, schedule, sampler and skipped steps, and the lines go to
rank 0's display. ``ft`` sits below ``train`` and imports nothing from it.
"""

from __future__ import annotations

import os

from .. import dist as gdist
from .replica import ReplicaGroup, StepQuorum, lighthouse_address

BARRIER_ENV = "GRADSYNC_FT_BARRIER"  # set by the one-machine launcher (cli/train_groups.py)




def join(group: ReplicaGroup, sess) -> None:
    """A fresh job launched on one machine: every group in the first quorum."""
    barrier = os.environ.get(BARRIER_ENV)
    if barrier and sess.start_step == 0 and not gdist.restart_count():
        group.wait_for_all(barrier, sess.cfg.run.timeout)


class QuorumCoordinator:
    """The quorum's side of a step's record, its announcements and the run's figures.

    Subclasses set :attr:`current` (this step's :class:`StepQuorum`) and say how a step
    begins, is dealt, summed and committed.
    """

    def __init__(self, sess):
        self.sess = sess
        ft = sess.cfg.ft  # the one reading of the run's ft section below train
        self.group, self.groups = ft.group, ft.groups  # this group's index, how many
        self.lighthouse, self.group_timeout = ft.lighthouse, ft.timeout
        self.current: StepQuorum | None = None
        self.last_members: list[int] | None = None
        self.why_not = ""  # why the last step did not commit

    def replica_group(self, state_fn, load_fn, last_step: int | None = None) -> ReplicaGroup:
        """This rank's :class:`ReplicaGroup`; ``state_fn`` gives what a healing peer
        receives, ``load_fn`` loads what this group receives; ``last_step``: the quorum
        step that ends the job (a group back after it stops, ``replica.job_over``), or
        None where the quorum's steps are not the run's (DiLoCo's syncs)."""
        sess = self.sess
        return ReplicaGroup(self.group, self.groups, lighthouse_address(self.lighthouse),
                            sess.rank, sess.world, state_fn, load_fn, sess.start_step,
                            timeout_s=self.group_timeout, quorum_timeout_s=sess.cfg.run.timeout,
                            last_step=last_step)

    @property
    def world_size(self) -> int:
        """The ranks that trained the step: every group of its quorum, each of this size."""
        return self.sess.world * self.current.size

    def totals(self, stats) -> tuple[float, float]:
        """This group's item count and loss sum (a sum across groups overrides it)."""
        return float(stats[:, 1].sum()), float(stats[:, 0].sum())

    def problem(self, loss: float, step: int) -> str | None:
        return None

    def observe(self, step, shares, busy) -> None:
        return None  # the quorum deals each step: no speed balancer across groups

    def end(self) -> bool:
        return False  # the last step's quorum is the end (DiLoCo: its last sync)

    def state_dict(self) -> None:
        return None  # a checkpoint's "balance": none across groups

    def load_state_dict(self, state) -> None:
        pass

    def record(self, report: dict) -> dict:
        """The step's quorum for its metrics line (members, attempts, seconds lost, healed),
        with the cross-group bytes added to the strategy's own ``sent_bytes``."""
        q = self.current
        return {**report, "sent_bytes": (report.get("sent_bytes") or 0) + q.sent_bytes,
                "quorum": list(q.members), "attempts": q.attempts,
                "lost_s": round(q.lost_s, 4), "quorum_s": round(q.quorum_s, 4),
                "healed": q.healed or None}

    def announce(self, committed: bool) -> None:
        """Rank 0's one line when the quorum changes, a step is redone or this group healed."""
        display, q = self.sess.display, self.current
        if not display:
            return
        if not committed:
            display.say(f"gradsync train: step {q.step} not committed ({self.why_not}); taking "
                        "it again with the next quorum, on the same samples")
            return
        if q.healed:
            display.say(f"gradsync train: healed at step {q.step}: model, optimizer, schedule "
                        f"and data position received from a live group ({q.quorum_s:.1f} s)")
        if self.last_members is not None and q.members != self.last_members:
            names = ", ".join(map(str, q.members))
            display.say(f"gradsync train: from step {q.step} the quorum is group"
                        f"{'s' * (len(q.members) != 1)} {names} (was "
                        f"{', '.join(map(str, self.last_members))})")
        self.last_members = list(q.members)

    def summary(self, rows: list[dict]) -> dict:
        """summary.json's ``fault_tolerance``: what this group went through, from its metrics
        (every committed step, every attempt that did not commit)."""
        steps = [r for r in rows if "loss" in r and r.get("quorum") is not None]
        sizes: dict[str, int] = {}
        for r in steps:
            sizes[str(len(r["quorum"]))] = sizes.get(str(len(r["quorum"])), 0) + 1
        return {"group": self.group, "groups": self.groups,
                "redone_steps": sum(1 for r in steps if (r.get("attempts") or 1) > 1),
                "failed_attempts": sum((r.get("attempts") or 1) - 1 for r in steps),
                "heals": sum(1 for r in steps if r.get("healed")),
                "lost_s": round(sum(r.get("lost_s") or 0.0 for r in steps), 3),
                "quorum_s": round(sum(r.get("quorum_s") or 0.0 for r in steps), 3),
                "steps_by_quorum_size": sizes}

    @staticmethod
    def summary_line(f: dict) -> str:
        """The closing table's line for :meth:`summary`'s figures."""
        sizes = ", ".join(f"{n} on {q}" for q, n in sorted(f["steps_by_quorum_size"].items()))
        return (f"group {f['group']} of {f['groups']}; steps by quorum size: {sizes or '-'}; "
                f"{f['redone_steps']} redone, {f['heals']} heal{'s' * (f['heals'] != 1)}, "
                f"{f['lost_s']:.1f} s lost")

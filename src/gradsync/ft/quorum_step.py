"""`gradsync train` across replica groups (``--ft-group``): a quorum every step, exact sums.

:class:`QuorumSteps` is the step coordinator of ``train/step/coordinator.py`` for
``--sync exact`` across replica groups; :func:`coordinator_for` is where worker setup
gets the one for its run (with ``--sync diloco``, ``local_groups.LocalGroups``).
What it does with each step, and knows of torchft:

* :meth:`QuorumSteps.begin` asks the lighthouse for the step's quorum
  (:meth:`ReplicaGroup.begin`); a group that was behind heals from a live peer and
  jumps ahead: what it receives is this rank's part of model and optimizer
  (``ft/transfer.py``), the schedule, the sampler's global position and the skipped
  steps;
* :meth:`QuorumSteps.deal` deals the step's global batch over the quorum's ranks and
  cuts this rank's part into micro-batches of at most ``--micro-batch``
  (``ft/shares.py``);
* :meth:`QuorumSteps.reduce` replaces the group's gradient by the quorum's exact mean
  (``ft/cross_reduce.py``), whose item count and loss sum are the step's totals;
* :meth:`QuorumSteps.commit` asks torchft whether every participant got through; if
  not, the step restores the sampler and the next quorum takes the same step on the
  same samples;
* :meth:`QuorumSteps.end`, after the last step: the job's end agreed across the groups
  (``closing.py``): a group that missed the last step heals into it.

The step's record, the lines said when the quorum changes and summary.json's figures
are every quorum coordinator's (``coordinator.py``).
"""

from __future__ import annotations

import math

from .closing import close_job
from .coordinator import QuorumCoordinator, join
from .cross_reduce import QuorumSums, cross_reduce
from .local_groups import LocalGroups
from .replica import ReplicaGroup
from .shares import micro_split, quorum_share
from .transfer import load_local_state, local_state


def coordinator_for(cfg) -> type:
    """The step coordinator of a replica group: a quorum every step (``--sync exact``), or a
    DiLoCo worker per group, a quorum at each sync (``local_groups.py``)."""
    return QuorumSteps if cfg.sync.method == "exact" else LocalGroups


class QuorumSteps(QuorumCoordinator):
    """Every step through the lighthouse's quorum (see the module docstring)."""

    strategy_options: dict = {}  # the session's strategy as it is

    def __init__(self, sess):
        super().__init__(sess)
        self.replica: ReplicaGroup | None = None
        self.sums: QuorumSums | None = None

    def start(self) -> None:
        """Join the replica groups: the lighthouse's quorum decides every step from now on."""
        sess = self.sess

        def state_fn() -> dict:
            return {"strategy": local_state(sess.strategy), "sched": sess.sched.state_dict(),
                    "sampler": sess.sampler.state_dict(), "skipped": list(sess.skipped)}

        def load_fn(state: dict) -> None:
            sess.faults.at_heal(sess.rank, self.replica.manager.current_step() + 1)
            load_local_state(sess.strategy, state["strategy"])
            sess.sched.load_state_dict(state["sched"])
            sess.sampler.load_state_dict(state["sampler"])
            sess.skipped[:] = state["skipped"]

        self.replica = self.replica_group(state_fn, load_fn, last_step=sess.cfg.run.steps)
        join(self.replica, sess)

    def begin(self, step: int) -> int:
        """This step's quorum; a group that was behind heals and jumps ahead."""
        self.current = self.replica.begin()
        return self.current.step

    def deal(self, block):
        """This rank's samples of ``block`` in this step's quorum, and its micro-batches."""
        q, world = self.current, self.sess.world
        mine = quorum_share(block, q.size, q.position, world, self.sess.rank)
        return mine, micro_split(mine, len(block), q.size * world, self.sess.cfg.batch.micro_batch)

    def reduce(self, items: float, loss_sum) -> None:
        """The quorum's exact mean gradient in place of the group's."""
        sess = self.sess
        self.sums = sums = cross_reduce(self.replica.manager, sess.strategy, items,
                                        float(loss_sum), sess.rank, sess.world,
                                        self.group, self.groups)
        self.current.members = list(sums.members)
        self.current.sent_bytes = sums.sent_bytes

    def totals(self, stats) -> tuple[float, float]:
        return self.sums.items, self.sums.loss_sum

    def problem(self, loss: float, step: int) -> str | None:
        if math.isfinite(loss):
            return None
        return f"non-finite loss ({loss}) at step {step} in another replica group"

    def commit(self) -> bool:
        """Whether every group got through the step (False: a group failed; redo it)."""
        ok = self.replica.commit()
        self.why_not = self.replica.why_not
        return ok

    def end_step(self, step: int, committed: bool) -> None:
        self.announce(committed)

    def end(self) -> bool:
        """The job's end, agreed across the groups (``closing.py``): a finished group holds
        the final model until every group has it; True: this group healed into the last
        step and saves its checkpoint."""
        return close_job(self.sess, self.replica)

    def close(self) -> None:
        if self.replica is not None:
            self.replica.shutdown()

"""`gradsync train --ft-groups N --sync diloco|streaming-diloco`: a DiLoCo worker per group.

Inside a group the inner steps are exact (the group's ranks run ddp); between
groups only the outer syncs travel (``ft/outer_sync.py``). What this file
decides, and why:

* **A quorum per sync, none between.** torchft's own DiLoCo takes its quorum when
  a sync is due; so does this. An inner step talks to nobody outside its group,
  so a failure elsewhere cannot stall it. Syncs are at the steps ``s`` with
  ``s % H == 0`` and at the last step.
* **The data of a round is dealt over the last sync's quorum.** Step ``s``'s
  global batch is dealt over the groups of the quorum that ended the previous
  round, as a multi-worker DiLoCo deals it over its workers (``block[g::Q]`` for
  equal counts), then over the group's ranks: with no failure every sample is
  used once, and a group's samples do not depend on its number of ranks.
* **A group that dies between syncs contributes nothing.** The next sync's
  quorum holds the groups alive then; the dead group's local work and its share
  of the round's samples are lost, and the others' sync proceeds.
* **A sync that does not commit is summed again, on every group that saw it
  fail, with the next quorum and the same pseudo-gradients** (the replicas and
  the global copy are untouched until a sum commits). This keeps the survivors'
  H steps of work, as the exact path redoes a step on the same samples; torchft's
  DiLoCo instead drops the round. A group that did commit is ahead: it has moved
  on and asks again at its next sync, where the others heal from it.
* **The quorum compares positions.** torchft heals a group whose step is behind
  the quorum's highest. The step given to torchft is ``s + 1`` at the sync after
  step ``s`` and ``c`` when a group (re)starts at its checkpoint's step ``c``, so
  a joining group, even one whose checkpoint holds that very sync, is behind the
  groups at the sync and heals: it receives the global copy, the outer and inner
  optimizer state, the schedule and the data position of a live peer, takes part
  in the sum with weight 0, and starts its inner steps from the new global copy.
  A group (re)starting sums with weight 0 in its first quorum; when every group
  of that quorum is starting (a fresh job, a whole job resumed) nobody brings
  work and no outer step is taken.
* **Streaming DiLoCo: a quorum at each step where a fragment is due**, summing
  the fragments due (``ft/outer_sync.py``'s ``GroupStreamingDiLoCo`` keeps each
  result until step + tau, so the plain run's trajectory holds). Which fragments a
  sum holds is read from the quorum's key after any heal: the join's key is the
  position (nothing due), a sync's is step + 1. torchft heals all groups but one
  at a fresh job's first quorum, and the healed group must sum what its peer sums.
"""

from __future__ import annotations

import copy
import time

import torch.distributed as dist

from ..data.split import deal
from .coordinator import QuorumCoordinator, join
from .outer_sync import GroupDiLoCo, GroupStreamingDiLoCo
from .replica import ReplicaGroup, StepQuorum
from .shares import even_counts, micro_split


def group_outer(module, inner, outer_optimizer, sync):
    """The DiLoCo of a worker that is a whole replica group (``outer_sync=`` of the engine's
    ``build_strategy``): its syncs are :class:`LocalGroups`', through the quorum."""
    if sync.method == "streaming-diloco":  # no thread: its comm group is never used
        return GroupStreamingDiLoCo(module, inner, outer_optimizer, sync_every=sync.every,
                                    fragments=sync.fragments, delay=sync.delay,
                                    alpha=sync.alpha, comm_group=dist.group.WORLD)
    return GroupDiLoCo(module, inner, outer_optimizer, sync_every=sync.every)


class LocalGroups(QuorumCoordinator):
    """The step coordinator of ``--sync diloco|streaming-diloco`` across replica groups: an
    inner step commits alone, dealt over the last sync's quorum; :meth:`end_step` takes
    the sync through the quorum when it is due (the module docstring says how)."""

    # one DiLoCo worker per group: exact ddp over the group's ranks, the outer sync here
    strategy_options = {"outer_sync": group_outer}

    def __init__(self, sess, replica: ReplicaGroup | None = None):
        super().__init__(sess)
        self.replica = replica
        self.position = sess.start_step  # inner steps this group has completed
        self.joined = False
        self.deal_over = (1, 0, [self.group])  # (quorum size, position, members)
        self.healed = False
        self.syncs: list[dict] = []  # this group's committed syncs (metrics events)

    def start(self) -> None:
        """Join the replica groups as one DiLoCo worker per group (quorums at syncs only)."""
        self.position = self.sess.start_step
        self.replica = self.replica_group(self.state, self.load)
        join(self.replica, self.sess)

    # ------------------------------------------------------------------ per step
    def begin(self, step: int) -> int:
        """The next step to take; the first call joins the groups (a quorum, healing)."""
        if not self.joined:
            self.joined = True
            self._sync(self.position, contribute=False)
        size, position, members = self.deal_over
        self.current = StepQuorum(step=self.position + 1, size=size, position=position,
                                  healed=self.healed, members=list(members))
        self.healed = False
        return self.current.step

    def deal(self, block):
        """This rank's samples of ``block``: dealt over the last sync's groups, then over the
        group's ranks; cut into micro-batches of at most ``--micro-batch``."""
        q, sess = self.current, self.sess
        group = deal(block, even_counts(len(block), q.size))[q.position]
        mine = deal(group, even_counts(len(group), sess.world))[sess.rank]
        return mine, micro_split(mine, len(block), q.size * sess.world,
                                 sess.cfg.batch.micro_batch)

    def reduce(self, items, loss_sum) -> None:
        """An inner step's gradient stays inside the group."""

    def commit(self) -> bool:
        return True  # an inner step commits alone; a sync commits through the quorum

    def end_step(self, step: int, committed: bool) -> None:
        self.announce(committed)
        if committed:
            self.after_step(step)

    def after_step(self, step: int) -> None:
        """Step ``step`` is done; sum the outer sync over the quorum when it is due."""
        self.position = step
        outer, last = self.sess.strategy.diloco, step == self.sess.cfg.run.steps
        if outer.due(step, last):
            if last:
                outer.settle()
            self._sync(step + 1, contribute=True)
    # ------------------------------------------------------------------ the sync
    def _sync(self, key: int, contribute: bool) -> None:
        """Quorum, sum and commit, again until a sum commits (module docstring)."""
        sess, replica = self.sess, self.replica
        outer = sess.strategy.diloco
        t0, attempts, joining = time.perf_counter(), 0, not contribute
        while True:
            attempts += 1
            state = replica.manager.state_dict()
            replica.manager.load_state_dict({**state, "step": key})
            q = replica.begin()  # heals here when behind (load below)
            if replica.healed_now:
                contribute = False
            # what this sum holds, from the position after a heal: a group joins at its own
            # position c (key c, nothing due), a sync after step s has key s + 1; a group
            # healed into either takes the peer's position and key (torchft's max step)
            last = self.position == sess.cfg.run.steps
            frags = outer.due(self.position, last,
                              joining=replica.manager.current_step() == self.position)
            sums = outer.quorum_sum(replica.manager, sess.rank, sess.world, self.group,
                                    self.groups, q.position, contribute, frags)
            if replica.commit():
                break
            self.why_not = replica.why_not
            if sess.display:
                sess.display.say(f"gradsync train: the sync after step {self.position} did not "
                                 f"commit ({self.why_not}); summing it again with the next "
                                 "quorum")
        outer.apply(sums, last)
        self.deal_over = (q.size, q.position, sums.members)
        event = {"event": "sync", "step": self.position, "quorum": sums.members,
                 "weights": sums.weights, "attempts": attempts,
                 "fragments": frags if isinstance(outer, GroupStreamingDiLoCo) else None,
                 "healed": self.healed or None, "joined": joining or None,
                 "seconds": round(time.perf_counter() - t0, 4), "sent_bytes": sums.sent_bytes}
        self.syncs.append(event)
        if sess.rank == 0 and sess.writer:
            sess.writer.write({k: v for k, v in event.items() if v is not None})

    # ------------------------------------------------------------------ healing
    def state(self) -> dict:
        """What a healing peer receives: a copy (this group keeps training)."""
        sess = self.sess
        module = sess.strategy.model.module
        return {"position": self.position,
                "module": {k: v.detach().clone() for k, v in module.state_dict().items()},
                "diloco": copy.deepcopy(sess.strategy.diloco.state_dict()),
                "sched": sess.sched.state_dict(), "sampler": sess.sampler.state_dict(),
                "skipped": list(sess.skipped)}

    def load(self, state: dict) -> None:
        sess = self.sess
        sess.faults.at_heal(sess.rank, state["position"] + 1)
        sess.strategy.model.module.load_state_dict(state["module"])
        sess.strategy.diloco.load_state_dict(state["diloco"])
        sess.strategy.diloco.forget()
        sess.sched.load_state_dict(state["sched"])
        sess.sampler.load_state_dict(state["sampler"])
        sess.skipped[:] = state["skipped"]
        self.position = state["position"]
        self.healed = True

    def close(self) -> None:
        if self.replica is not None:
            self.replica.shutdown()

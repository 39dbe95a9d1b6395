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

from .. import dist as gdist
from ..data.split import deal
from ..engine.strategy.builders import outer_sgd
from ..engine.strategy.inexact import HostModel, LocalUpdateStrategy
from .outer_sync import GroupDiLoCo, GroupStreamingDiLoCo
from .replica import ReplicaGroup, StepQuorum, lighthouse_address
from .shares import even_counts, micro_split


def regroup(sess) -> LocalUpdateStrategy:
    """The session's ``--sync diloco|streaming-diloco`` strategy (a worker per rank) as one
    worker per group: exact ddp over the group's ranks, the outer step through the quorum.
    The module, inner optimizer and schedule are the session's own, and so is any
    state a resumed checkpoint loaded into them."""
    old, cfg = sess.strategy, sess.cfg
    module = old.model.module
    cap = 25.0 if cfg.sync.bucket_cap_mb == "auto" else float(cfg.sync.bucket_cap_mb)
    model = HostModel(module, None, cap)  # the group's world: exact inside the group
    opt = (module, old.optimizer, outer_sgd(cfg.sync.outer_lr, cfg.sync.outer_momentum))
    if cfg.sync.method == "streaming-diloco":  # no thread: its comm group is never used
        outer = GroupStreamingDiLoCo(*opt, sync_every=cfg.sync.every, fragments=cfg.sync.fragments,
                                     delay=cfg.sync.delay, alpha=cfg.sync.alpha,
                                     comm_group=old.diloco.comm_group)
    else:
        outer = GroupDiLoCo(*opt, sync_every=cfg.sync.every)
    outer.load_state_dict(old.diloco.state_dict())  # a resumed run's global copy, items
    new = LocalUpdateStrategy(old.name, old.precision, model, old.optimizer, outer)
    new.collectives = getattr(old, "collectives", "native")
    return new


class LocalGroups:
    """What the loop holds as ``sess.ft`` for local updates: the per-step surface of a
    :class:`ReplicaGroup` (``begin``, ``current``, ``commit``) without a quorum per
    step, and :meth:`after_step`, which takes the sync through the quorum."""

    local = True

    def __init__(self, sess, replica: ReplicaGroup):
        self.sess, self.replica = sess, replica
        self.position = sess.start_step  # inner steps this group has completed
        self.joined = False
        self.current: StepQuorum | None = None
        self.deal = (1, 0, [sess.cfg.ft.group])  # (quorum size, position, members)
        self.healed = False
        self.why_not = ""
        self.last_members: list[int] | None = None
        self.syncs: list[dict] = []  # this group's committed syncs (metrics events)

    @property
    def manager(self):
        return self.replica.manager

    # ------------------------------------------------------------------ per step
    def begin(self) -> StepQuorum:
        """The next step to take; the first call joins the groups (a quorum, healing)."""
        if not self.joined:
            self.joined = True
            self._sync(self.position, contribute=False)
        size, position, members = self.deal
        self.current = StepQuorum(step=self.position + 1, size=size, position=position,
                                  healed=self.healed, members=list(members))
        self.healed = False
        return self.current

    def commit(self) -> bool:
        return True  # an inner step commits alone; a sync commits through the quorum

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
            sums = outer.quorum_sum(replica.manager, sess.rank, sess.world, sess.cfg.ft.group,
                                    sess.cfg.ft.groups, q.position, contribute, frags)
            if replica.commit():
                break
            self.why_not = replica.why_not
            if sess.display:
                sess.display.say(f"gradsync train: the sync after step {self.position} did not "
                                 f"commit ({self.why_not}); summing it again with the next "
                                 "quorum")
        outer.apply(sums, last)
        self.deal = (q.size, q.position, sums.members)
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

    def shutdown(self) -> None:
        self.replica.shutdown()


def attach_local(sess, barrier: str | None) -> LocalGroups:
    """Join the replica groups as one DiLoCo worker per group (quorums at syncs only)."""
    cfg = sess.cfg
    sess.strategy = regroup(sess)
    holder: list[LocalGroups] = []
    replica = ReplicaGroup(cfg.ft.group, cfg.ft.groups, lighthouse_address(cfg.ft.lighthouse),
                           sess.rank, sess.world, lambda: holder[0].state(),
                           lambda s: holder[0].load(s), sess.start_step,
                           timeout_s=cfg.ft.timeout, quorum_timeout_s=cfg.run.timeout)
    holder.append(LocalGroups(sess, replica))
    if barrier and sess.start_step == 0 and not gdist.restart_count():
        replica.wait_for_all(barrier, cfg.run.timeout)  # a fresh job: all in the first quorum
    return holder[0]


def share(sess, block: list[int]) -> tuple[list[int], list[list[int]]]:
    """This rank's samples of ``block``: dealt over the last sync's groups, then over the
    group's ranks; cut into micro-batches of at most ``--micro-batch``."""
    q = sess.ft.current
    group = deal(block, even_counts(len(block), q.size))[q.position]
    mine = deal(group, even_counts(len(group), sess.world))[sess.rank]
    return mine, micro_split(mine, len(block), q.size * sess.world, sess.cfg.batch.micro_batch)


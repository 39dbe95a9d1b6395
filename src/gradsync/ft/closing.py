"""The job's end, agreed across replica groups: nobody leaves while a group that can still
come back lacks the final model.

Before this, a group that missed the last step (left out of its quorum, or
restarting when the others finished) waited for a quorum that could never form:
the others had exited, so it failed with ``QuorumTimeout`` after ``--timeout``,
was restarted by its launcher, and waited again (issue 35: 55 minutes with the
documented defaults before exit 1). Now the end is a protocol of the groups:

* **Closing rounds.** A group that committed the last step does not leave. It
  takes *closing rounds*: a quorum at the last step (``start_quorum`` with the
  manager's step set to ``--steps``), then a sum over the quorum of a small header
  (which groups took part, whether a group wants to stop, which groups are known
  gone), then torchft's commit, so every rank of every member learns the same
  thing.
* **A group behind joins a round and heals into the end.** A group waiting in the
  lighthouse (left out, or back from a restart) is taken into the next round, as
  into any quorum, and receives the final model, optimizer, schedule and data
  position from a finished group, before that round's sum: the sum is also the
  barrier that keeps its sender alive until the transfer is done. Its loop then
  stops (the quorum's step is past ``--steps``), and the training loop saves its
  checkpoint of the last step: it ends with the final model, exit code 0.
* **When it is over.** Rounds repeat every ``CLOSE_POLL_S`` until a round holds
  every group (or every group not known gone: the one-machine launcher marks a
  group whose launcher exited in ``GRADSYNC_FT_BARRIER``), or ``END_WAIT_S`` (at
  most ``--timeout``) has passed since this group finished: then a group that is
  down and not yet back is not waited for. A group that comes back after that
  finds the lighthouse's last quorum at the job's end with none of its members
  alive, and stops in one line instead of waiting (``ReplicaGroup.job_over``).
* **Agreed, never by clock alone.** Each rank's wish to stop (its clock) and what
  it knows of gone groups are first agreed inside its group (a max over the
  group's ranks), then summed across groups in the header: every rank of every
  member stops after the same round.

With no fault every group finished the same step, the first round holds them all,
and the end costs one quorum and one small sum (milliseconds).

Not covered: ``--sync diloco|streaming-diloco`` (a quorum at each outer sync; its
last sync is after the last step, and a group absent from it keeps its own
model), which ``close_job`` leaves as it was.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
from torch.distributed import ReduceOp

from ..engine.transport import comm
from ..errors import GradsyncError
from .replica import QUORUM_TRY_S, ReplicaGroup

END_WAIT_S = 60.0  # how long finished groups hold the final model for a group not yet back
CLOSE_POLL_S = 0.5  # between closing rounds
GONE_PREFIX = "gone-"  # GRADSYNC_FT_BARRIER/gone-G: group G's launcher has exited
BARRIER_ENV = "GRADSYNC_FT_BARRIER"


@dataclass
class Ending:
    """How this group's part of the job ended, for its metrics line and its log."""

    final: bool  # this group holds the final model
    healed: bool = False  # received it in a closing round
    rounds: int = 0
    members: list[int] = field(default_factory=list)  # the last round's groups
    gone: list[int] = field(default_factory=list)
    seconds: float = 0.0
    why: str = ""  # what ended the rounds

    def event(self, step: int) -> dict:
        return {"event": "end", "step": step, "final": self.final, "healed": self.healed or None,
                "rounds": self.rounds, "members": self.members, "gone": self.gone or None,
                "seconds": round(self.seconds, 3), "why": self.why}


def gone_groups(directory: str | None, groups: int) -> set[int]:
    """Groups the launcher marked gone (their launcher exited), from ``directory``."""
    if not directory:
        return set()
    try:
        names = os.listdir(directory)
    except OSError:
        return set()
    return {int(n[len(GONE_PREFIX):]) for n in names
            if n.startswith(GONE_PREFIX) and n[len(GONE_PREFIX):].isdigit()
            and int(n[len(GONE_PREFIX):]) < groups}


def mark_gone(directory: str, group: int) -> None:
    """The launcher's mark: group ``group`` will not come back (its launcher exited)."""
    try:
        open(os.path.join(directory, f"{GONE_PREFIX}{group}"), "w").close()
    except OSError:
        pass


def close_job(sess, group: ReplicaGroup) -> bool:
    """After the training loop: the closing rounds (module docstring) of ``group``, this
    rank's replica group in the worker's session ``sess``; True when this group healed
    into the last step and must save that step's checkpoint. Called by
    ``quorum_step.QuorumSteps.end`` (DiLoCo across groups: its last sync is its end)."""
    steps = sess.cfg.run.steps
    ending = close(group, steps, device=sess.device,
                   end_wait_s=min(END_WAIT_S, group.quorum_timeout_s),
                   gone_dir=os.environ.get(BARRIER_ENV))
    if sess.rank == 0:
        if sess.writer:
            sess.writer.write(ending.event(steps))
        if sess.display:
            line = _line(ending, group, steps)
            if line:
                sess.display.say(line)
    return ending.final and ending.healed


def _line(e: Ending, group: ReplicaGroup, steps: int) -> str:
    if not e.final:
        return f"gradsync train: {group.ended_note}"
    if e.healed:
        return (f"gradsync train: healed into the job's end (step {steps}): the final model, "
                "optimizer, schedule and data position received from a group that finished")
    missing = sorted(set(range(group.groups)) - set(e.members) - set(e.gone))
    if missing:
        return (f"gradsync train: the job's end without group{'s' * (len(missing) > 1)} "
                f"{', '.join(map(str, missing))} ({e.why}, {e.seconds:.0f} s); a group that "
                "comes back now stops at once, without the final model")
    return ""


def close(group: ReplicaGroup, steps: int, *, device, end_wait_s: float,
          gone_dir: str | None) -> Ending:
    """The closing rounds of this rank; see the module docstring."""
    t0 = time.monotonic()
    q = group.current
    if q is not None and q.ended:  # back after the end: nobody left to heal from
        return Ending(final=False, why="job over")
    healed = q is not None and q.step > steps and q.healed  # healed in a closing round
    ending = Ending(final=not healed, healed=healed)
    joined = healed  # the round's quorum is the one this group healed in
    everyone = set(range(group.groups))
    while True:
        if not joined:
            manager = group.manager
            manager.load_state_dict({**manager.state_dict(), "step": steps})
            if not _quorum(group):
                ending.why = "no quorum"  # fewer than a majority are closing: nobody to wait for
                break
        joined = False
        ending.rounds += 1
        stop_here = time.monotonic() - t0 > end_wait_s
        ok, members, stop, gone = _round(group, device, stop_here,
                                         gone_groups(gone_dir, group.groups))
        if healed and ending.rounds == 1:
            if not ok:
                raise GradsyncError(f"replica group {group.group}: healing into the job's end "
                                    f"(step {steps}) failed ({group.why_not}); its launcher "
                                    "restarts it, and it heals again if a finished group is "
                                    "still there")
            ending.final = True  # the state received in this round's quorum is the final one
        ending.members, ending.gone = sorted(members), sorted(gone)
        if ok and members | gone >= everyone:
            ending.why = "every group" if not gone else "every group not gone"
            break
        if (ok and stop) or stop_here:
            ending.why = f"end wait {end_wait_s:.0f} s"
            break
        time.sleep(CLOSE_POLL_S)
    ending.seconds = time.monotonic() - t0
    return ending


def _quorum(group: ReplicaGroup) -> bool:
    """One closing round's quorum; False when none forms within ``QUORUM_TRY_S``."""
    try:
        group.manager.start_quorum(allow_heal=True, timeout=timedelta(seconds=QUORUM_TRY_S))
        return True
    except (TimeoutError, RuntimeError):
        group.manager._quorum_future = None  # torchft re-raises a failed request
        return False


def _round(group: ReplicaGroup, device, stop_here: bool,
           gone: set[int]) -> tuple[bool, set[int], bool, set[int]]:
    """(committed, members, a member wants to stop, groups known gone) of one round."""
    n = group.groups
    mine = torch.zeros(1 + n, dtype=torch.float64, device=device)
    mine[0] = float(stop_here)
    for g in gone:
        mine[1 + g] = 1.0
    comm.all_reduce(mine, op=ReduceOp.MAX, tag="ft_close_agree")  # one answer per group
    header = torch.zeros(2 * n + 1, dtype=torch.float64, device=device)
    header[group.group] = 1.0
    header[n:] = mine
    group.manager.allreduce(header, reduce_op=ReduceOp.SUM).wait()
    ok = bool(group.manager.should_commit())
    if not ok:
        err = group.manager.errored()
        cause = getattr(err, "original_exception", err) if err else None
        group.why_not = str(cause).split(". ")[0][:160] if cause else "a member failed"
    values = header.tolist()
    members = {g for g in range(n) if values[g] > 0.5}
    return ok, members, values[n] > 0.5, {g for g in range(n) if values[n + 1 + g] > 0.5}

"""One replica group's side of the per-step quorum: torchft's Manager, and what each step saw.

Every step starts with :meth:`ReplicaGroup.begin`: torchft's lighthouse decides
the quorum (which groups take part), and a group whose step is behind the
quorum's -- a restarted or new one -- receives the state of a live peer before
it trains (``use_async_quorum=False``: the healing happens before the forward, so
the healed group takes part in this very step). The quorum fixes this group's
position ``r`` of ``Q``, which is all :mod:`shares` needs to deal the step's
samples. After the backward, :func:`cross_reduce.cross_reduce` sums the
gradients over the quorum, and :meth:`ReplicaGroup.commit` asks torchft whether
every participant got through the step; only then may the optimizer step. A step
that does not commit is redone, on the same samples, by the next quorum.

Split brain: two quorums training side by side would each make a different
model. The lighthouse's ``--min_replicas`` prevents it when it is a majority of
the groups (``default_min_groups``); the one-machine launcher sets it so.

What a step records (:class:`StepQuorum`): the members whose gradients the
committed sum holds, how many attempts it took, the seconds lost in failed
attempts, the seconds the committing attempt waited for its quorum, and
whether this group healed from a peer at it.

Three moments around the steps, and why each is here:

* **The start** (:meth:`ReplicaGroup.begin`, first call of a fresh job): the groups
  ask for their first quorum only once every group heartbeats to the lighthouse
  (``lighthouse_status.py``), so the first quorum holds them all on a cluster as on
  one machine. At that quorum torchft sends the first group's state to the others
  (``init_sync``: the engine establishes identical replicas, as DataParallel
  broadcasts rank 0's); that is the start's sync, not a heal (nobody was behind),
  and is counted apart (``synced_at_start``).
* **A left-out or restarted group** asks, waits in the lighthouse, is taken into
  the next quorum (the lighthouse waits for every group that heartbeats,
  ``lighthouse.py``) and heals there. When the job has ended while it was away
  (the lighthouse's last quorum was the job's end and none of its members is alive),
  :meth:`ReplicaGroup.begin` says so instead of waiting out ``--timeout``.
* **The end** (``closing.py``): the groups that finished the last step hold the
  final model until every group has it or has gone.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch

from .. import dist as gdist
from ..errors import GradsyncError, UsageError
from .addresses import check_addresses
from .lighthouse import default_min_groups
from .lighthouse_status import GROUP_ID_PREFIX, LighthouseStatus, fetch_page, parse, read_status
from .requirement import torchft

QUORUM_TRY_S = 5.0  # one quorum request's bound; repeated up to --timeout (_join_quorum)
BARRIER_POLL_S = 0.1  # the start barrier's look at the lighthouse
REACH_POLL_S = 0.2  # after a failure, how often to see whether the lighthouse answers

__all__ = ["GROUP_ID_PREFIX", "QUORUM_TRY_S", "QuorumTimeout", "ReplicaGroup", "StepQuorum",
           "default_min_groups", "lighthouse_address"]


class QuorumTimeout(GradsyncError):
    """No quorum within the run's --timeout (said in one line on every rank)."""


@dataclass
class StepQuorum:
    """What one step's quorum was, for its metrics line (``rundir.StepRecord``)."""

    step: int
    size: int
    position: int
    attempts: int = 1
    lost_s: float = 0.0
    quorum_s: float = 0.0
    healed: bool = False
    members: list[int] = field(default_factory=list)
    sent_bytes: int = 0
    ended: bool = False  # the job ended while this group was away: no step to take


def cross_group_pg(tf, timeout_s: float):
    """The process group between replica groups: torchft's NCCL one when this rank
    trains on a GPU (the gradients to sum live there), its gloo one on the CPU."""
    timeout = timedelta(seconds=timeout_s)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return tf.ProcessGroupBabyNCCL(timeout=timeout)  # a subprocess: an abort stays there
    return tf.ProcessGroupGloo(timeout=timeout)


def _device_sync() -> None:
    """Wait for the GPU's queued work, so a stream the caller does not own reads final
    values (torchft's state transfer reads and writes on streams of its own)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.current_stream().synchronize()


class ReplicaGroup:
    """This rank's handle on its group's torchft Manager.

    ``state_fn()`` returns this rank's state for a healing peer, ``load_fn(state)``
    loads one received; ``start_step`` is the number of steps already committed
    (a resumed checkpoint's step), which the quorum compares across groups;
    ``last_step`` is the job's last step (``--steps``), which tells a group that
    comes back after the job's end that there is nothing left to join.
    """

    def __init__(self, group: int, groups: int, lighthouse: str, rank: int, world: int,
                 state_fn, load_fn, start_step: int, timeout_s: float,
                 quorum_timeout_s: float, last_step: int | None = None):
        if not 0 <= group < groups:
            raise UsageError(f"--ft-group must be in [0, {groups}) for --ft-groups {groups}, "
                             f"got {group}")
        tf = torchft()
        self.group, self.groups, self.rank, self.world = group, groups, rank, world
        self.lighthouse, self.quorum_timeout_s = lighthouse, quorum_timeout_s
        self.last_step = last_step
        self._load_fn = load_fn
        self.healed_now = False
        self.synced_at_start = False  # received the first group's state at a fresh start
        check_addresses(lighthouse, os.environ.get("MASTER_ADDR", "localhost"))
        pg = cross_group_pg(tf, timeout_s)
        host, port, self._store_server = attempt_store(rank, quorum_timeout_s)

        def state_for_peer():  # torchft reads it on its own stream: values final first
            _device_sync()
            return state_fn()

        self.manager = tf.Manager(
            pg=pg, load_state_dict=self._load, state_dict=state_for_peer, min_replica_size=1,
            use_async_quorum=False, replica_id=f"{GROUP_ID_PREFIX}{group}",
            lighthouse_addr=lighthouse, rank=rank, world_size=world,
            store_addr=host, store_port=port,
            timeout=timedelta(seconds=timeout_s),
            quorum_timeout=timedelta(seconds=quorum_timeout_s),
            connect_timeout=timedelta(seconds=quorum_timeout_s), init_sync=True)
        self.manager.load_state_dict({"step": int(start_step), "batches_committed": 0})
        self._fresh = start_step == 0 and not gdist.restart_count()
        self._suspect = False  # after a failure: ask only once the lighthouse answers
        self._started = False
        self._first_try: dict[int, float] = {}
        self._tries: dict[int, int] = {}
        self.current: StepQuorum | None = None
        self.failed_attempts = 0
        self.heals = 0
        self.why_not = ""  # why the last step did not commit
        self.last_members: list[int] | None = None
        self.ended_note = ""  # why this group ends without the final model (job over)

    def _load(self, state) -> None:
        # at a quorum whose highest step is 0 torchft sends the first group's state to
        # every other (init_sync): the start's sync, nobody was behind, no heal
        if self.manager.current_step() == 0:
            self.synced_at_start = True
        else:
            self.healed_now = True
            self.heals += 1
        _device_sync()  # torchft cloned the received tensors on its own stream
        self._load_fn(state)
        _device_sync()

    def wait_for_all(self, directory: str, timeout_s: float) -> None:
        """A fresh job's first quorum holds every group (one machine: ``GRADSYNC_FT_BARRIER``).

        The lighthouse forms a quorum as soon as a majority asks; a group still
        importing torch would then join a step later and heal, which is correct
        but makes the first steps depend on start-up timing. Each group marks
        itself ready in the launcher's directory and waits (at most ``timeout_s``)
        for the others' marks. (The lighthouse barrier of :meth:`begin` does the same
        on a cluster; on one machine both hold, the second at once.)
        """
        os.makedirs(directory, exist_ok=True)
        open(os.path.join(directory, f"group-{self.group}.rank-{self.rank}"), "w").close()
        deadline = time.monotonic() + timeout_s
        want = {f"group-{g}.rank-0" for g in range(self.groups)}
        while not want <= set(os.listdir(directory)) and time.monotonic() < deadline:
            time.sleep(0.05)

    def start_barrier(self) -> str:
        """Wait until every group heartbeats to the lighthouse (a fresh job's first quorum
        then holds them all); what ended the wait, for the tests and the log.

        The lighthouse waits for every group that heartbeats (``lighthouse.py``), but a
        group whose workers are still starting does not heartbeat yet, and the first
        majority to ask would start without it: it would join a step later and heal.
        A group that finds a quorum already formed is a replacement in a running job
        and does not wait (a last quorum whose members are all gone is an earlier job's,
        on a lighthouse used again). A page this reader does not know ends the wait (the quorum
        is still correct, only not complete at the start); so does ``--timeout``.
        """
        deadline = time.monotonic() + self.quorum_timeout_s
        want = set(range(self.groups))
        while time.monotonic() < deadline:
            page = fetch_page(self.lighthouse)
            if page is not None:
                status = parse(page)
                if status is None:
                    return "unknown status page"
                if status.quorum_id > 0 and status.members_alive():
                    return "job running"  # a replacement: the others are training
                if want <= status.alive_groups():
                    return "all groups alive"
            time.sleep(BARRIER_POLL_S)
        return "timeout"

    def begin(self) -> StepQuorum:
        """Join this step's quorum (healing first if behind); the step to take, 1-based.

        A step past ``last_step`` with ``ended`` set: the job ended while this group was
        away (``ended_note`` says so); the loop stops there."""
        if not self._started:
            self._started = True
            if self._fresh:
                self.start_barrier()
        t0 = time.perf_counter()
        self.healed_now = False
        if not self._join_quorum(t0):
            self.current = StepQuorum(step=(self.last_step or 0) + 1, size=0, position=0,
                                      quorum_s=time.perf_counter() - t0, ended=True)
            return self.current
        position = self.manager.participating_rank()
        size = self.manager.num_participants()
        if position is None:
            raise RuntimeError(f"replica group {self.group} is not in the quorum it joined")
        step = self.manager.current_step() + 1
        self._first_try.setdefault(step, t0)
        self._tries[step] = self._tries.get(step, 0) + 1
        self.current = StepQuorum(step=step, size=size, position=position,
                                  attempts=self._tries[step],
                                  lost_s=t0 - self._first_try[step],
                                  quorum_s=time.perf_counter() - t0, healed=self.healed_now)
        return self.current

    def _join_quorum(self, t0: float) -> bool:
        """``start_quorum``, asked again every ``QUORUM_TRY_S`` until ``quorum_timeout_s``;
        False: the job has ended without this group (:meth:`job_over`).

        torchft's quorum request does not survive the lighthouse's death: the request
        in flight waits out its timeout even when a new lighthouse is up on the same
        address (measured: a group failed 60 s later). A fresh request reaches the new
        one, so the request is bounded and repeated; the whole wait is still bounded
        by the run's ``--timeout``, after which the error says what was waited for.
        """
        while True:
            if self._suspect:
                self._await_lighthouse(t0)
            try:
                self.manager.start_quorum(allow_heal=True,
                                          timeout=timedelta(seconds=QUORUM_TRY_S))
                self._suspect = False
                return True
            except (TimeoutError, RuntimeError) as e:
                self.manager._quorum_future = None  # torchft re-raises a failed request
                self._suspect = True
                status = read_status(self.lighthouse)
                note = self.job_over(status)
                if note:
                    self.ended_note = note
                    return False
                waited = time.perf_counter() - t0
                if waited + QUORUM_TRY_S > self.quorum_timeout_s:
                    said = f"; the lighthouse says: {status.next_status[:160]}" if status else ""
                    raise QuorumTimeout(
                        f"replica group {self.group}: no quorum in {waited:.0f} s (--timeout "
                        f"{self.quorum_timeout_s:.0f}): the lighthouse at {self.lighthouse} is "
                        f"unreachable, or fewer groups than its --min_replicas are alive "
                        f"({type(e).__name__}: {str(e)[:120]}){said}") from None

    def _await_lighthouse(self, t0: float) -> None:
        """After a failure, ask only once the lighthouse answers (at most ``--timeout``).

        A request sent while the lighthouse is out of reach (this group's link down, the
        lighthouse restarting) is lost without an answer: torchft's manager does not
        pass the error on, and the request waits out its ``QUORUM_TRY_S``. A group cut
        off by a partition then asked again up to 5 s after its link was back and missed
        a step it could have joined (measured on netlab: back at +0.0 s, asked at
        +4.1 s). Its status page answers within milliseconds once reachable.
        """
        while time.perf_counter() - t0 < self.quorum_timeout_s:
            if fetch_page(self.lighthouse, timeout_s=1.0) is not None:
                return
            time.sleep(REACH_POLL_S)

    def job_over(self, status: LighthouseStatus | None) -> str:
        """:func:`job_over` for this group; never for a group of a fresh job, which has no
        part in any quorum the lighthouse remembers (one used again for a new job still
        shows the last job's end)."""
        if self._fresh:
            return ""
        return job_over(status, self.last_step, self.group, self.manager.current_step())

    def commit(self) -> bool:
        """Whether every group of the quorum got through this step (torchft decides);
        False: drop the gradient and take the step again."""
        err = self.manager.errored()
        ok = bool(self.manager.should_commit())
        if not ok:
            self.failed_attempts += 1
            self._suspect = True  # a peer or a link failed: is the lighthouse in reach?
            cause = getattr(err, "original_exception", err) if err else None
            self.why_not = (str(cause).split(". ")[0][:160] if cause else
                            "another group of the quorum failed")
        elif self.current is not None:
            self._first_try.pop(self.current.step, None)
            self._tries.pop(self.current.step, None)
        return ok

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)


def job_over(status: LighthouseStatus | None, last_step: int | None, group: int,
             step: int) -> str:
    """Why the job is over for ``group`` (at ``step``), or "": the lighthouse's last quorum
    was the job's end (its members had committed ``last_step``: ``closing.py``) and none
    of them heartbeats any more, so no group that holds the final model is left."""
    if status is None or last_step is None or not status.members:
        return ""
    if min(status.members.values()) < last_step or status.members_alive():
        return ""
    names = ", ".join(map(str, sorted(status.member_groups())))
    return (f"replica group {group}: the job ended (step {last_step}, groups {names}) while "
            f"this group was away; no group that holds the final model is left to send it, so "
            f"this group stops at its step {step}; the final model is in those groups' run "
            f"directories")


def attempt_store(rank: int, timeout_s: float):
    """(host, port, server or None): a store of this launch attempt's own for the Manager.

    torchft's Manager publishes rank 0's manager address in the store it is given,
    and every rank reads it there. torchrun's store outlives a restart of the
    workers, so with it a restarted rank 1 could read the address of the rank 0
    that died and send its quorum requests nowhere (seen: a restarted group of two
    workers never joined a quorum). Rank 0 of each attempt starts a new TCPStore and
    publishes its port under a key named by the attempt.
    """
    from torch.distributed import TCPStore
    from torch.distributed.distributed_c10d import _get_default_store

    from ..dist import restart_count

    key = f"gradsync_ft/manager_store/{restart_count()}"
    store = _get_default_store()
    host = os.environ.get("MASTER_ADDR", "localhost")
    server = None
    if rank == 0:
        server = TCPStore(host, 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout_s))
        store.set(key, str(server.port))
    port = int(store.get(key).decode())
    return host, port, server


def lighthouse_address(given: str | None) -> str:
    """``--ft-lighthouse``, else torchft's own ``TORCHFT_LIGHTHOUSE``."""
    addr = given or os.environ.get("TORCHFT_LIGHTHOUSE")
    if not addr:
        raise UsageError("--ft-group needs the lighthouse's address: --ft-lighthouse "
                         "http://HOST:29510 (or TORCHFT_LIGHTHOUSE); start one with "
                         "torchft_lighthouse --min_replicas M, or let gradsync train "
                         "--ft-groups N start it on this machine")
    return addr if "://" in addr else f"http://{addr}"

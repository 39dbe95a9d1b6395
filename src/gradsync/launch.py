"""Start K workers with torch's elastic launcher (the machinery behind torchrun).

``spawn`` is what tests, examples and notebooks use; ``gradsync train`` uses the
same :func:`launch`. Workers start from a forkserver that has already imported
torch, so a launch costs a fraction of a second instead of a fresh interpreter
per worker. If any worker raises or dies, the elastic agent stops the others and
:class:`WorkerFailedError` names the failed rank and its error; processes are
never left behind.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable

import torch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ErrorHandler
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as _rdzv
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from . import dist as gdist
from . import hang_report
from .errors import UsageError
from .failures import SECONDARY, describe_failures, restart_failures
from .forkserver import startup_environ
from .forkserver.start import ensure_running as _start_forkserver
from .heap import keep_freed_memory
from .lifeline import die_with

_ECHO_GRACE_S = 3.0
# After a worker fails, the most the agent waits for its peers' flight records
# (_let_peers_record). A peer that never meets the broken connection costs a restart
# these seconds.
PEER_RECORD_WAIT_S = 5.0


def _caller_name(depth: int = 2) -> str:
    """torch's ``dynamic_rendezvous.get_method_name``, from the frame instead of
    ``inspect.stack()``.

    The rendezvous names each of its events after the calling method, and torch 2.13
    finds it with two ``inspect.stack()`` calls, which read the source lines of every
    frame: 1.5 s of every launch on this machine (9 events; 6.3 s for a whole
    launch of 2 workers), more under load, spent on a name the default logging
    throws away. The same name, the same depth (0 is this function).
    """
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:
        return "no_method_name"


@contextlib.contextmanager
def _fast_rendezvous_names():
    """:func:`_caller_name` in torch's rendezvous for the duration of one launch, torch's
    own outside it: importing gradsync changes nothing in torch (a user's own torchrun
    or elastic launch in the same process keeps torch's behaviour)."""
    torch_own = _rdzv.get_method_name
    _rdzv.get_method_name = _caller_name
    try:
        yield
    finally:
        _rdzv.get_method_name = torch_own


def _record_and_die(exc: BaseException) -> None:
    """Write elastic's error file for this rank, then exit at once.

    Exiting without first tearing the process group down matters: the peers'
    collectives fail only when this process is gone, so the agent always sees
    the root cause exit first and names the right rank.
    """
    if not isinstance(exc, KeyboardInterrupt) and SECONDARY.search(f"{type(exc).__name__}: {exc}"):
        # A peer's death surfaced here as a broken connection. Give the agent time
        # to see the peer exit first, so the report names the cause, not the echo.
        # (Not after SIGTERM/Ctrl-C: the agent is already stopping everyone, and a
        # restart should not wait.)
        time.sleep(_ECHO_GRACE_S)
    try:
        ErrorHandler().record_exception(exc)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130 if isinstance(exc, KeyboardInterrupt) else 1)


# Set by the elastic agent for each worker: never overwritten with the caller's values.
_AGENT_KEYS = frozenset({
    "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE",
    "WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING", "OMP_NUM_THREADS"})


def _caller_environment() -> dict[str, str]:
    """The caller's environment now, minus what the agent sets per worker.

    Workers fork from a forkserver started at the first launch, so they inherit its
    environment, not the caller's current one; this snapshot travels with each
    launch and is applied first thing in the worker.
    """
    return {k: v for k, v in os.environ.items() if not _set_by_agent(k)}


def _set_by_agent(key: str) -> bool:
    return key in _AGENT_KEYS or key.startswith(("TORCHELASTIC_", "TORCH_ELASTIC_"))


def _worker_entry(fn: Callable, backend: str | None, timeout_s: float | None,
                  threads: int, args: tuple, environ: dict | None = None,
                  launcher_pid: int | None = None):
    if launcher_pid is not None:
        die_with(launcher_pid)  # no worker outlives a SIGKILLed launcher (lifeline.py)
    if environ is not None:
        startup_environ.become(environ, _set_by_agent)
    torch.set_num_threads(threads)
    keep_freed_memory()
    try:
        gdist.init(backend, timeout_s)
        result = fn(*args)
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the agent
        _record_and_die(exc)
    gdist.shutdown()
    return result


def _wait_for_records(run_id: str, attempt: int, peers: dict[int, Callable[[], bool]]) -> None:
    """Until each of ``peers`` (global rank: is its process alive) has a flight record of
    ``attempt`` or has exited, at most PEER_RECORD_WAIT_S."""
    folder = hang_report.flight_dir(run_id) / f"attempt-{attempt}"
    deadline = time.monotonic() + PEER_RECORD_WAIT_S
    while time.monotonic() < deadline:
        if all(not alive() or (folder / f"rank-{r}.json").exists()
               for r, alive in peers.items()):
            return
        time.sleep(0.05)


def _let_peers_record(pcontext, worker_group, attempt: int) -> None:
    """Let the surviving workers write their flight records before torch stops them.

    torch's process context (``torch.multiprocessing.ProcessContext.join``, polled by
    the agent) sends SIGTERM to every other worker in the same call that sees one fail.
    A peer blocked in a collective with the dead rank needs a moment to see the broken
    connection and write the record the hang report names the dead rank from; a peer
    busy computing meets it at its next collective. Both lost that race (a loaded CI
    machine; deterministically, a peer computing for a second). So ``join`` first waits
    until each surviving worker on this node has its record or has exited, at most
    PEER_RECORD_WAIT_S (one that never reaches a collective costs the restart those
    seconds); with no survivor there is nobody to wait for. torch then names the worker
    that failed first: the survivors that ended meanwhile (each an echo of that failure)
    are left out of what it looks at. Wrapped per attempt, on the context object only;
    an unknown torch layout keeps torch's behaviour.
    """
    pc = getattr(pcontext, "_pc", None)
    if pc is None or not all(hasattr(pc, a) for a in ("join", "sentinels", "processes")):
        return
    join = pc.join
    global_rank = {w.local_rank: w.global_rank for w in worker_group.workers}
    run_id = worker_group.spec.rdzv_handler.get_run_id()

    def join_after_records(timeout=None, grace_period=None):
        ready = multiprocessing.connection.wait(list(pc.sentinels), timeout=timeout)
        failed = {pc.sentinels[s] for s in ready if pc.processes[pc.sentinels[s]].exitcode}
        if failed:
            peers = {global_rank[i]: p.is_alive for i, p in enumerate(pc.processes)
                     if i not in failed and i in global_rank and p.is_alive()}
            if peers:
                _wait_for_records(run_id, attempt, peers)
            pc.sentinels = {s: i for s, i in pc.sentinels.items() if i in failed}
        return join(timeout, grace_period)

    pc.join = join_after_records


@contextlib.contextmanager
def _watch_restarts(on_restart: Callable[[list[dict]], None] | None):
    """Tell ``on_restart`` which workers failed, before the agent restarts them; and
    give the other workers a moment to record the failure before they are stopped
    (:func:`_let_peers_record`).

    torch's agent keeps a failed attempt's record to itself and only says "restart"
    in its log. For the duration of one launch, the agent class the launcher builds
    is a subclass that keeps the failures it saw and hands them over when the next
    attempt's workers start (every worker of the failed attempt is stopped by then,
    so the callback may write where they wrote). Restored on the way out.
    """
    import torch.distributed.launcher.api as launcher_api

    base = launcher_api.LocalElasticAgent

    class RecordingAgent(base):
        _gradsync_failed = None

        def _monitor_workers(self, worker_group):
            result = super()._monitor_workers(worker_group)
            if result.failures:
                self._gradsync_failed = result.failures
            return result

        def _start_workers(self, worker_group):
            failed, self._gradsync_failed = self._gradsync_failed, None
            if failed and on_restart is not None:
                try:
                    on_restart(restart_failures(failed))
                except Exception as e:  # noqa: BLE001 - a note must not stop the restart
                    print(f"gradsync: could not record the restart: {e}", file=sys.stderr)
            started = super()._start_workers(worker_group)
            _let_peers_record(getattr(self, "_pcontext", None), worker_group,
                              worker_group.spec.max_restarts - self._remaining_restarts)
            return started

    launcher_api.LocalElasticAgent = RecordingAgent
    try:
        yield
    finally:
        launcher_api.LocalElasticAgent = base


@contextlib.contextmanager
def _quiet_elastic():
    """Elastic logs every failure at ERROR level; our exception says it once, clearly.

    Each elastic module's logger has its own level (``get_logger`` sets it), so
    raising the parent's alone lets them through: every one is raised, and
    ``torch.multiprocessing.spawn``'s, which announces each SIGTERM the agent sends.
    """
    prefixes = ("torch.distributed.elastic", "torch.multiprocessing.spawn")
    loggers = [logging.getLogger(p) for p in prefixes] + [
        logger for name, logger in logging.root.manager.loggerDict.items()
        if name.startswith(tuple(p + "." for p in prefixes)) and isinstance(logger, logging.Logger)]
    previous = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, previous):
            logger.setLevel(level)


@contextlib.contextmanager
def _restore_signal_handlers():
    """The agent installs handlers for SIGINT/SIGTERM; put the caller's back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    sigs = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT]
    saved = {s: signal.getsignal(s) for s in sigs}
    try:
        yield
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


def launch(fn: Callable, nproc: int, args: tuple = (), *, backend: str | None = None,
           timeout_s: float | None = None, threads: int = 1,
           rdzv_endpoint: str = "localhost:0", nnodes: int = 1, run_id: str | None = None,
           quiet: bool = True, max_restarts: int = 0,
           on_restart: Callable[[list[dict]], None] | None = None) -> dict[int, object]:
    """Run ``fn(*args)`` on ``nproc`` local workers (of ``nnodes`` nodes) with the group set up.

    Returns ``{global rank: return value}`` for this node's workers. With
    ``max_restarts`` the agent restarts every worker after a failure, up to that
    many times (``fn`` must then continue from what it saved, as
    ``gradsync train`` does); the error names the last attempt's failure, and
    ``on_restart`` (in this process) receives each restarted attempt's failures
    (:func:`restart_failures`) before the new workers start.
    """
    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
        raise UsageError(f"number of worker processes must be an integer >= 1, got {nproc!r}")
    gdist.resolve_backend(backend)
    _start_forkserver()
    config = LaunchConfig(
        min_nodes=nnodes, max_nodes=nnodes, nproc_per_node=nproc,
        rdzv_backend="c10d", rdzv_endpoint=rdzv_endpoint,
        run_id=run_id or f"gradsync-{uuid.uuid4().hex[:12]}",
        max_restarts=max_restarts, monitor_interval=0.05, start_method="forkserver",
    )
    quiet_ctx = _quiet_elastic() if quiet else contextlib.nullcontext()
    with quiet_ctx, _restore_signal_handlers(), _watch_restarts(on_restart), \
            _fast_rendezvous_names():
        try:
            return elastic_launch(config, _worker_entry)(fn, backend, timeout_s, threads, args,
                                                         _caller_environment(), os.getpid())
        except ChildFailedError as err:
            raise hang_report.attach(describe_failures(err), config.run_id) from None
        except RuntimeError as err:
            # a Ctrl-C that lands while torch's rendezvous starts its keep-alive thread:
            # torch's own clean-up then raises "cannot join thread before it is started"
            # over the KeyboardInterrupt (seen once in 3 suites, exit 1 with a traceback)
            if isinstance(err.__context__, KeyboardInterrupt):
                raise KeyboardInterrupt from None
            raise


def spawn(fn: Callable, world_size: int, *args, backend: str | None = None,
          timeout_s: float | None = None, threads: int = 1) -> list:
    """Run ``fn(*args)`` on ``world_size`` local processes; return their results by rank.

    ``fn`` must be importable by name (a module-level function). Each worker has
    the default process group initialised (gloo on CPU, NCCL with CUDA) with a
    collective timeout of ``timeout_s`` (default ``GRADSYNC_TIMEOUT_S`` or 300 s)
    and ``threads`` intra-op threads. If a worker raises or dies, the others are
    stopped and :class:`gradsync.WorkerFailedError` names the failed rank.
    """
    results = launch(fn, world_size, args, backend=backend, timeout_s=timeout_s, threads=threads)
    return [results[r] for r in range(world_size)]

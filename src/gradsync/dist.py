"""Process-group set-up from torchrun's environment, and rank/world helpers.

``init()`` is what a training script calls first, under torchrun or inside
:func:`gradsync.spawn`. It picks NCCL when CUDA is present and gloo otherwise,
binds the process to its local GPU, and gives every collective a timeout so a
lost peer becomes an error instead of a hang.

Two things make it survive torchrun's elastic restarts (``--max-restarts``):

* Under torchrun the workers share the agent's TCPStore, and it outlives a
  restart; torch keys the default group's rendezvous by group name only, so
  restarted workers read the *dead* workers' addresses and gloo connects to
  ports nobody listens on any more (measured: 2 of 3 restarts of a plain
  2-worker script failed this way, torch 2.13). ``init()`` keys it by run id,
  restart count and world size instead.
* gloo's connection set-up has its own retry loop that ``init_process_group``'s
  timeout does not bound. A watchdog thread ends the process, with a message,
  when set-up has not finished within the timeout, so the launcher sees a failed
  worker (and restarts it, if it has restarts left) instead of a hang.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from . import nccl_rules
from .errors import UsageError

BACKENDS = ("auto", "gloo", "nccl")
_REQUIRED_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
CONNECT_EXIT_CODE = 75  # EX_TEMPFAIL: "try again" -- what a restart is for


def default_timeout_s() -> float:
    """Collective timeout: ``GRADSYNC_TIMEOUT_S`` or 300 s."""
    raw = os.environ.get("GRADSYNC_TIMEOUT_S", "300")
    try:
        value = float(raw)
    except ValueError:
        raise UsageError(f"GRADSYNC_TIMEOUT_S must be a number of seconds, got {raw!r}") from None
    if value <= 0:
        raise UsageError(f"GRADSYNC_TIMEOUT_S must be > 0, got {raw!r}")
    return value


def resolve_backend(backend: str | None) -> str:
    """'auto'/None -> nccl with CUDA, gloo without; checks an explicit choice."""
    backend = (backend or "auto").lower()
    if backend not in BACKENDS:
        raise UsageError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise UsageError("backend 'nccl' needs CUDA GPUs and none is available; use --backend gloo")
    return backend


def check_local_devices(backend: str, local_workers: int, gpus: int | None = None) -> None:
    """One NCCL rank per GPU: more workers on a host than it has GPUs is refused here,
    in one line, instead of "invalid device ordinal" on the extra ranks (NCCL also
    refuses two ranks on one GPU: "Duplicate GPU detected", seen on an H100)."""
    if backend != "nccl":
        return
    gpus = torch.cuda.device_count() if gpus is None else gpus
    if local_workers > gpus:
        raise UsageError(
            f"{local_workers} workers on this host but {gpus} GPU(s) visible: NCCL runs one "
            f"worker per GPU; use --workers {gpus}"
            + (" (or --backend gloo to run them on the CPU)" if gpus else ""))


def comm_device(group=None) -> torch.device:
    """The device a group's collectives move tensors on: the current GPU under NCCL,
    the CPU under gloo, and the emulated accelerator's under ``GRADSYNC_NCCL_RULES``.

    The one door for it: every buffer the engine allocates for communication is
    allocated here, so a CPU tensor never meets a NCCL group."""
    if not dist.is_initialized():
        return torch.device("cpu")
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if backend == nccl_rules.BACKEND:
        return nccl_rules.group_device(group)
    return torch.device("cpu")


def nccl_like(group=None) -> bool:
    """Does this group follow NCCL's rules (NCCL itself, or gloo under
    ``GRADSYNC_NCCL_RULES``)? Choices made per backend ask this, not the name."""
    return dist.get_backend(group) in ("nccl", nccl_rules.BACKEND)


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device


def _env_int(name: str) -> int:
    try:
        return int(os.environ[name])
    except ValueError:
        raise UsageError(
            f"environment variable {name}={os.environ[name]!r} is not an integer"
        ) from None


def info() -> DistInfo:
    """Rank, world size, local rank, backend and device of this process."""
    if not dist.is_initialized():
        return DistInfo(0, 1, 0, "none", torch.device("cpu"))
    backend = dist.get_backend()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, backend,
                    comm_device())


class ConnectTimeout(RuntimeError):
    """Process-group set-up did not finish in time (what the watchdog records)."""


def _record_for_launcher(exc: BaseException) -> None:
    """Write torchelastic's error file for this worker, if it was started by an agent."""
    if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        return
    with contextlib.suppress(Exception):
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(exc)


@contextlib.contextmanager
def connect_watchdog(seconds: float, what: str):
    """Exit the process (code 75) with a message if the block takes longer than ``seconds``.

    For the one place where waiting cannot be interrupted from Python: native
    connection set-up. The message goes to stderr and torchelastic's error file.
    """
    done = threading.Event()

    def watch():
        if done.wait(seconds):
            return
        exc = ConnectTimeout(f"{what} did not finish within {seconds:g} s; giving up so the "
                             "launcher can restart the workers (torchrun --max-restarts), "
                             "or raise --timeout")
        print(f"gradsync: rank {os.environ.get('RANK', '?')}: error: {exc}", file=sys.stderr,
              flush=True)
        _record_for_launcher(exc)
        os._exit(CONNECT_EXIT_CODE)

    thread = threading.Thread(target=watch, name="gradsync-connect-watchdog", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()


def _agent_store(timeout: timedelta):
    """The elastic agent's store, keyed by run, restart and world size (None: no agent)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], _env_int("MASTER_PORT"),
                          _env_int("WORLD_SIZE"), is_master=False, timeout=timeout)
    key = (f"gradsync/{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/"
           f"attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
           f"world-{os.environ['WORLD_SIZE']}/default_pg")
    return dist.PrefixStore(key, store)


def init(backend: str | None = None, timeout_s: float | None = None) -> DistInfo:
    """Initialise the default process group from torchrun's environment variables.

    Idempotent: returns the existing group's info when already initialised.
    Set-up (store, rendezvous, connections) is bounded by the same timeout as
    the collectives; past it the process exits with code 75 and a message.
    """
    if dist.is_initialized():
        return info()
    missing = [k for k in _REQUIRED_ENV if k not in os.environ]
    if missing:
        raise UsageError(
            f"not launched by torchrun or gradsync: {', '.join(missing)} unset. Run under "
            "`torchrun --nproc-per-node N script.py`, `gradsync train`, or gradsync.spawn()"
        )
    backend = resolve_backend(backend)
    local_rank = _env_int("LOCAL_RANK") if "LOCAL_RANK" in os.environ else 0
    seconds = timeout_s if timeout_s is not None else default_timeout_s()
    timeout = timedelta(seconds=seconds)
    what = (f"process-group set-up ({backend}, rank {os.environ['RANK']} of "
            f"{os.environ['WORLD_SIZE']}, store {os.environ['MASTER_ADDR']}:"
            f"{os.environ['MASTER_PORT']})")
    _import_dynamo_first()
    with connect_watchdog(seconds, what):
        store = _agent_store(timeout)
        kwargs = {} if store is None else {"store": store, "rank": _env_int("RANK"),
                                           "world_size": _env_int("WORLD_SIZE")}
        if backend == "nccl":
            local_world = (_env_int("LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in os.environ
                           else local_rank + 1)
            check_local_devices("nccl", max(local_world, local_rank + 1))
            # torch's own NCCL flight recorder, dumped when its watchdog times a collective
            # out (gradsync's ring is written before that: engine/transport/flight_recorder)
            os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
            os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
            torch.cuda.set_device(local_rank)
            dist.init_process_group("nccl", timeout=timeout,
                                    device_id=torch.device("cuda", local_rank), **kwargs)
        elif nccl_rules.enabled():  # gloo under NCCL's rules (nccl_rules.py)
            dist.init_process_group(nccl_rules.register(), timeout=timeout, **kwargs)
        else:
            dist.init_process_group("gloo", timeout=timeout, **kwargs)
    return info()


def _import_dynamo_first() -> None:
    """Import ``torch._dynamo`` before the process group exists.

    torch imports it lazily, e.g. when the first optimizer is built. Imported after
    ``init_process_group`` it keeps a reference to the default group, so
    ``destroy_process_group`` no longer stops gloo's worker threads; at interpreter
    exit one of them may then free a work's tensors while Python shuts down, and the
    process aborts ("terminate called without an active exception", exit -6 after a
    finished run; measured in 1 of 4 torchrun runs of the chaos test). Imported
    first, the group goes away with ``destroy_process_group`` (threads 4 -> 1).
    """
    import torch._dynamo  # noqa: F401


def shutdown() -> None:
    """Destroy the default process group if there is one."""
    if dist.is_initialized():
        dist.destroy_process_group()


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def is_main() -> bool:
    return rank() == 0


def restart_count() -> int:
    """How many times the elastic launcher has restarted this worker group (0: first launch)."""
    raw = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    try:
        return int(raw)
    except ValueError:
        return 0

"""Everything the launching process can check before starting processes, checked once, clearly.

``gradsync train`` and ``gs.train`` (when they launch workers) call :func:`preflight`
before any process exists: the batch splits over ``--workers``, ``--data-parts`` fits
them, the backend exists, a built-in dataset holds a global batch, the port is free,
the run directory is writable with room for a save; then it takes the directory's lock
and reads the checkpoint (every byte verified) to decide: fresh, continue, or finished.
Each problem is one line, exit code 2, before anything starts. Under ``torchrun`` rank 0
of the worker group makes the same checks (``worker/setup.py``).
"""

from __future__ import annotations

import os
import socket

from ... import dist as gdist
from ...errors import UsageError
from ...rundir import CHECKPOINT
from ...safeload import trusting
from ..checkpoint import state
from ..checkpoint.guard import RunLock, check_run_dir
from ..checkpoint.size import space_needed
from ..checkpoint.unit import read_unit
from ..config.parts_flags import check_data_parts_world
from ..config.train_config import TrainConfig
from ..task.build import builtin_data
from ..task.builtins import DATASETS


def _check_port_free(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            raise UsageError(f"port {port} on localhost is already in use; choose another "
                             "--port or leave it out to pick a free one") from None


def preflight(cfg: TrainConfig, model_fn=None) -> tuple[state.ResumePlan, RunLock]:
    """Everything that can be checked before starting processes, checked once, clearly.

    Returns the resume decision and the run directory's lock, held (release it).
    """
    try:
        cfg.accumulation(cfg.workers)
        split = True
    except UsageError:  # a continued run keeps its batch: said once its checkpoint is read
        if not os.path.exists(os.path.join(cfg.out, CHECKPOINT)):
            raise
        split = False
    check_data_parts_world(cfg, cfg.workers)  # P divides K: said before any worker starts
    gdist.check_local_devices(gdist.resolve_backend(cfg.backend), cfg.workers)  # GPUs per worker
    if cfg.data in DATASETS:
        try:
            n = len(builtin_data(cfg.data, cfg).train)
        except ValueError as e:  # e.g. a sequence longer than the whole corpus
            raise UsageError(f"--data {cfg.data}: {e}") from None
        if n < cfg.global_batch:
            raise UsageError(f"--data {cfg.data} holds {n} sample{'' if n == 1 else 's'}, "
                             "fewer than one global "
                             f"batch ({cfg.global_batch}); every step needs distinct samples")
    if cfg.port:
        _check_port_free(cfg.port)
    created = not os.path.exists(cfg.out)
    check_run_dir(cfg.out, space_needed(cfg, model_fn), overwrite=cfg.overwrite)
    lock = RunLock(cfg.out, created=created).acquire()
    try:
        path = os.path.join(cfg.out, CHECKPOINT)
        with trusting(cfg.trust_checkpoint_code):  # data only, unless the user opted in
            plan = state.decide(cfg, read_unit(path))  # verified: the whole unit, every byte
        lock.claim()  # gradsync's run directory from now on (guard.py)
        if not split:  # on resume: the worker counts and micro-batches that carry it
            cfg.accumulation(cfg.workers, resuming=plan.action != "fresh")
    except BaseException:
        lock.release()
        raise
    return plan, lock

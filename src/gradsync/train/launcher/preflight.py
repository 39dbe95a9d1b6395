"""Everything the launching process can check before starting processes, checked once, clearly.

``gradsync train`` and ``gs.train`` (when they launch workers) call :func:`preflight`
before any process exists. What only the launching machine can check is checked
here: the backend's devices for ``--workers``, a built-in dataset holds a global
batch, the port is free. The rest -- the batch splits over the workers, the run
directory is writable with room for a save, its lock, the checkpoint read (every byte
verified) and the decision (fresh, continue, or finished) -- is
:func:`~gradsync.train.config.plan.plan_run`, the same function a torchrun worker
group's rank 0 calls (``worker/setup.py``). Each problem is one line, exit code 2,
before anything starts.
"""

from __future__ import annotations

import socket
from collections.abc import Callable

from ... import dist as gdist
from ...errors import UsageError
from ..checkpoint.guard import RunLock
from ..config.plan import RunPlan, check_data_size, plan_run, same_command_on
from ..config.run_config import RunConfig
from ..task.build import builtin_data
from ..task.builtins import DATASETS


def _check_port_free(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            raise UsageError(f"port {port} on localhost is already in use; choose another "
                             "--port or leave it out to pick a free one") from None


def preflight(cfg: RunConfig, model_fn=None,
              continue_with: Callable[[int], str] = same_command_on) -> tuple[RunPlan, RunLock]:
    """Everything that can be checked before starting processes, checked once, clearly.

    Returns the run's plan and the run directory's lock, held (release it).
    ``continue_with(n)``: how the user continues on ``n`` workers (``plan_run``).
    """
    def launcher_checks() -> None:  # after the batch and the world, before the directory
        gdist.check_local_devices(gdist.resolve_backend(cfg.run.backend), cfg.run.workers)
        if cfg.run.data in DATASETS:
            try:
                n = len(builtin_data(cfg.run.data, cfg).train)
            except ValueError as e:  # e.g. a sequence longer than the whole corpus
                raise UsageError(f"--data {cfg.run.data}: {e}") from None
            check_data_size(cfg, n)
        if cfg.run.port:
            _check_port_free(cfg.run.port)

    return plan_run(cfg, cfg.run.workers, model_fn=model_fn, continue_with=continue_with,
                    before_directory=launcher_checks)

"""``--log tensorboard,csv,wandb,mlflow``: the metrics, also through each library's own writer.

``metrics.jsonl`` stays the run's record (the report reads it, resumes cut it back);
the trackers receive the same step records after each line is written there
(``fanout.py``). Each writes into the run directory, with no network:

=============  ==========================================  ===================
name           writer                                      files
=============  ==========================================  ===================
tensorboard    ``torch.utils.tensorboard.SummaryWriter``   ``RUN/tb/``
csv            the standard library's ``csv.DictWriter``   ``RUN/metrics.csv``
wandb          ``wandb.init(mode="offline")``              ``RUN/wandb/``
mlflow         ``MlflowClient``, a file store              ``RUN/mlruns/``
=============  ==========================================  ===================

This module is import-light on purpose: :class:`~gradsync.train.TrainConfig` calls
:func:`check_log` in every process, so an unknown name or a missing package is
refused before any worker starts, in one line naming the pip command, and nothing
of a tracker's library is imported unless it was asked for.
"""

from __future__ import annotations

import importlib.util

from ....errors import UsageError

# name -> (the module that must be importable, the pip package that brings it)
TRACKERS: dict[str, tuple[str | None, str | None]] = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "csv": (None, None),  # the standard library's csv module
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow-skinny"),
}
EXTRA = "log"  # pip install 'gradsync[log]' brings every tracker's package


def parse_log(text: str) -> list[str]:
    """``"tensorboard, csv"`` -> ``["tensorboard", "csv"]`` (order kept, repeats dropped)."""
    names: list[str] = []
    for part in (text or "").split(","):
        name = part.strip().lower()
        if not name:
            continue
        if name not in TRACKERS:
            raise UsageError(f"unknown --log tracker {name!r}; choose from "
                             f"{', '.join(TRACKERS)} (comma-separated)")
        if name not in names:
            names.append(name)
    return names


def missing_package(name: str) -> str | None:
    """The pip package tracker ``name`` needs and this environment lacks, or None."""
    module, package = TRACKERS[name]
    if module is None:
        return None
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    return None if found else package


def check_log(text: str) -> str:
    """``--log`` checked and normalised (``"tensorboard,csv"``); one line if not usable."""
    names = parse_log(text)
    for name in names:
        package = missing_package(name)
        if package:
            raise UsageError(f"--log {name} needs the {package} package, which is not "
                             f"installed: pip install 'gradsync[{EXTRA}]' (or pip install "
                             f"{package})")
    return ",".join(names)

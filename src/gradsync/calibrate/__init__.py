"""Measure this machine: the backend's alpha/beta and the model's per-parameter backward.

Unlike ``gradsync.plan`` (pure arithmetic), this package starts processes and
runs the model; it writes the ``StepProfile`` the simulator reads, so plans are
calibrated on the user's own hardware. ``links`` (imported by name, not here: it
is also run as ``python -m gradsync.calibrate.links`` under torchrun) measures the
intra- and inter-host links of hosts of several ranks for ``plan.two_level``.
"""

from .backward import BackwardTiming, measure_single, measure_under_workers, time_passes
from .collectives import (
    OPS,
    CollectiveCalibration,
    OpTiming,
    default_sizes,
    log_sizes,
    time_collectives,
)
from .overlap import OverlapPenalty, measure_overlap_worker
from .session import Calibration, calibrate
from .workload import Workload, build_workload

__all__ = [
    "OPS",
    "BackwardTiming",
    "Calibration",
    "CollectiveCalibration",
    "OpTiming",
    "OverlapPenalty",
    "Workload",
    "build_workload",
    "calibrate",
    "default_sizes",
    "log_sizes",
    "measure_single",
    "measure_overlap_worker",
    "measure_under_workers",
    "time_collectives",
    "time_passes",
]

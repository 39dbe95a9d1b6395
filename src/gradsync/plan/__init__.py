"""The planner: pure maths answered before launching, no process group, no rendering.

memory.py     per-device bytes of DP and ZeRO-1/2/3, activations, fits verdict
batch.py      global batch in tokens -> samples and accumulation per worker count
comm.py       alpha-beta cost of ring/tree/hierarchical all-reduce, parameter server
profile.py    the step profile the simulator reads (JSON, versioned), synthetic models
simulate.py   event simulation of one step over the engine's own bucket plan; sweep
calibrate_fit.py  least-squares alpha/beta from measured timings
two_level.py  ring/tree/server/hierarchical all-reduce on hosts: intra and inter links
units.py      parsing of counts, sizes, rates and times (GB = 1e9 bytes)

Each returns dataclasses; ``gradsync.observe`` renders them (tables, PNGs, HTML).
Importing this package imports neither torch nor any rendering library.
"""

from .batch import BatchPlan, plan_batch
from .calibrate_fit import AlphaBetaFit, fit_alpha_beta
from .comm import CommPlan, plan_comm
from .memory import ActivationShape, MemoryPlan, plan_memory, resolve_param_count
from .profile import ParamProfile, StepProfile, load_profile, synthetic_profile
from .simulate import StepResult, Sweep, simulate_step, sweep_bucket_sizes
from .two_level import AlgorithmCost, Link, TwoLevelTopology

__all__ = [
    "ActivationShape", "AlgorithmCost", "AlphaBetaFit", "BatchPlan", "CommPlan", "Link",
    "MemoryPlan", "ParamProfile", "StepProfile", "StepResult", "Sweep", "TwoLevelTopology",
    "fit_alpha_beta", "load_profile", "plan_batch", "plan_comm", "plan_memory",
    "resolve_param_count", "simulate_step", "sweep_bucket_sizes", "synthetic_profile",
]

"""What the simulator needs to know about one step: the profile and its JSON file.

A profile is per worker: forward time, each parameter's size and the backward
time until its gradient is ready (registration order), optimizer time, the
link's alpha and beta, and the world size. ``gradsync calibrate`` will measure
one and write it as JSON with a ``version`` field; a file from another version is
refused with one line rather than simulated wrongly. ``synthetic_profile`` builds a
uniform L-layer model so the simulator works before anything is measured.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

from ..engine.buckets.plan import ParamSpec
from ..errors import UsageError

PROFILE_VERSION = 1


@dataclass(frozen=True)
class ParamProfile:
    """One parameter: size and the backward time until its gradient is ready."""

    name: str
    numel: int
    itemsize: int
    backward_s: float
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.numel < 0 or self.itemsize <= 0:
            raise UsageError(f"parameter {self.name!r}: numel must be >= 0 and itemsize >= 1")
        if not self.backward_s >= 0:
            raise UsageError(f"parameter {self.name!r}: backward_s must be >= 0")


@dataclass(frozen=True)
class StepProfile:
    """What one step costs, per worker; ``params`` in registration order."""

    forward_s: float
    params: tuple[ParamProfile, ...]
    optimizer_s: float
    alpha_s: float
    beta_s_per_byte: float
    world_size: int
    # Measured by `gradsync calibrate` where workers share cores with gloo (see
    # plan/contention.py); 0 = overlap is free, the model before calibration existed.
    overlap_compute_penalty: float = 0.0  # backward rate is 1 - this while comm is in flight
    overlap_comm_penalty: float = 0.0  # all-reduce rate is 1 - this while backward computes

    def __post_init__(self) -> None:
        if not self.params:
            raise UsageError("profile has no parameters")
        for name in ("overlap_compute_penalty", "overlap_comm_penalty"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0 <= v < 1):
                raise UsageError(f"profile {name} must be a number in [0, 1), got {v!r}")
        for name in ("forward_s", "optimizer_s", "alpha_s", "beta_s_per_byte"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise UsageError(f"profile {name} must be a number >= 0, got {v!r}")
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise UsageError(f"world size must be >= 1, got {self.world_size!r}")

    @property
    def backward_s(self) -> float:
        return sum(p.backward_s for p in self.params)

    def specs(self) -> list[ParamSpec]:
        return [ParamSpec(p.name, p.numel, p.itemsize, p.dtype) for p in self.params]

    def with_(self, **changes) -> StepProfile:
        d = {f: getattr(self, f) for f in self.__dataclass_fields__}
        d.update(changes)
        return StepProfile(**d)


def synthetic_profile(
    layers: int = 24,
    params_per_layer: int = 1_000_000,
    backward_s_per_layer: float = 2e-3,
    tensors_per_layer: int = 4,
    itemsize: int = 4,
    forward_s: float | None = None,
    optimizer_s: float = 0.0,
    alpha_s: float = 1e-3,
    bandwidth: float = 1e9,
    world_size: int = 2,
) -> StepProfile:
    """An L-layer uniform model; each layer split into equal tensors.

    Forward defaults to half the backward time (backward computes two products
    per matmul, forward one). The interactive page (observe/simulate_page.js)
    rebuilds exactly this profile in JavaScript when its layer slider moves, so
    keep the two in step.
    """
    for name, v in (("layers", layers), ("params per layer", params_per_layer),
                    ("tensors per layer", tensors_per_layer)):
        if v < 1:
            raise UsageError(f"{name} must be >= 1, got {v}")
    if bandwidth <= 0:
        raise UsageError(f"bandwidth must be > 0, got {bandwidth}")
    if backward_s_per_layer < 0:
        raise UsageError(f"backward time per layer must be >= 0, got {backward_s_per_layer}")
    base, extra = divmod(params_per_layer, tensors_per_layer)
    params = []
    for layer in range(layers):
        for j in range(tensors_per_layer):
            numel = base + (1 if j < extra else 0)
            params.append(ParamProfile(
                f"layers.{layer}.p{j}", numel, itemsize,
                backward_s_per_layer * numel / params_per_layer,
            ))
    fwd = layers * backward_s_per_layer / 2 if forward_s is None else forward_s
    return StepProfile(fwd, tuple(params), optimizer_s, alpha_s, 1.0 / bandwidth, world_size)


def profile_to_json(profile: StepProfile) -> str:
    d = asdict(profile)
    d["params"] = [asdict(p) for p in profile.params]
    return json.dumps({"version": PROFILE_VERSION, **d}, indent=1)


def profile_from_dict(d: dict) -> StepProfile:
    """Read a profile written by ``gradsync calibrate`` (or by hand); version must match."""
    if not isinstance(d, dict) or "version" not in d:
        raise UsageError("profile has no 'version' field")
    if d["version"] != PROFILE_VERSION:
        raise UsageError(
            f"profile version {d['version']!r} is not supported (this gradsync reads "
            f"version {PROFILE_VERSION}); re-run gradsync calibrate"
        )
    try:
        params = tuple(ParamProfile(**p) for p in d["params"])
        return StepProfile(
            float(d["forward_s"]), params, float(d.get("optimizer_s", 0.0)),
            float(d["alpha_s"]), float(d["beta_s_per_byte"]), int(d["world_size"]),
            float(d.get("overlap_compute_penalty", 0.0)), float(d.get("overlap_comm_penalty", 0.0)),
        )
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, UsageError):
            raise
        raise UsageError(f"malformed profile: {type(e).__name__}: {e}") from None


def load_profile(path: str) -> StepProfile:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise UsageError(f"cannot read profile {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise UsageError(f"profile {path} is not JSON: {e.msg} at line {e.lineno}") from None
    except UnicodeDecodeError as e:
        raise UsageError(f"profile {path} is not JSON: byte 0x{e.object[e.start]:02x} at "
                         f"offset {e.start} is not UTF-8") from None
    return profile_from_dict(data)

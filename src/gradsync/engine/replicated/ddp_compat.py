"""torch DDP's constructor keywords and methods, on DataParallel where they mean something.

A user switching from ``DistributedDataParallel(model, device_ids=[rank],
process_group=pg, static_graph=True)`` should not have to delete arguments one
TypeError at a time, nor have one silently mean something else:

* ``process_group``: the same as ``group``.
* ``device_ids`` / ``output_device``: DDP's one-device-per-process form only: None,
  or the device the module is on (``[k]`` / ``k`` for ``cuda:k``); DDP itself
  requires None for a CPU module, and so does this.
* ``dim``: 0 only (nothing is scattered: each rank is fed its own batch).
* ``gradient_as_bucket_view``: accepted, either value; gradsync's gradients are
  always views of their bucket (DDP's ``True``), so no copy precedes communication.
* ``static_graph``: ``True`` lets a parameter receive its gradient several times in
  one backward (reentrant activation checkpointing of a module used twice), as in
  DDP: the first synchronised backward counts the arrivals (``sync/arrivals.py``). Nothing
  else needs the hint (buckets are rebuilt once in the observed order; unused
  parameters follow ``find_unused_parameters``).
* ``init_sync``: True only: rank 0's state is always broadcast at construction.

Anything else is a TypeError, as for any unknown keyword. Methods
(:class:`DDPMethods`): ``register_comm_hook`` with torch's built-in hooks, mapped to
gradsync's compressors, and the ``require_backward_grad_sync`` flag.
"""

from __future__ import annotations

import copy

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

from ...errors import UsageError
from ..compress import CompressedBuckets, HalfPrecisionCompressor, PowerSGDCompressor

DDP_KEYWORDS = ("process_group", "device_ids", "output_device", "dim",
                "gradient_as_bucket_view", "static_graph", "init_sync")


def _same_device(value, device: torch.device) -> bool:
    if isinstance(value, int) and not isinstance(value, bool):
        return device.type != "cpu" and device.index == value
    try:
        return torch.device(value) == device
    except (TypeError, RuntimeError):
        return False


def accept_module_keys(state_dict, prefix, *_args) -> None:
    """Load-state-dict pre-hook: a wrapper inside a parent module (a GAN, an EMA holder)
    is saved with the module's own keys (``state_dict()`` drops ``module.``), so the
    parent's ``load_state_dict`` must accept them: rename ``prefix + k`` to
    ``prefix + "module." + k`` (keys already prefixed are left alone)."""
    inner = prefix + "module."
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + key[len(prefix):]] = state_dict.pop(key)



def resolve_ddp_keywords(module: torch.nn.Module, group, kwargs: dict):
    """Check DDP's keywords in ``kwargs``; return the process group to use."""
    unknown = sorted(set(kwargs) - set(DDP_KEYWORDS))
    if unknown:
        raise TypeError(f"DataParallel got unexpected keyword argument(s) {unknown}")
    pg = kwargs.get("process_group")
    if pg is not None:
        if group is not None and group is not pg:
            raise UsageError("DataParallel: pass group or process_group (the same thing), "
                             "not two different groups")
        group = pg
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    for key in ("device_ids", "output_device"):
        value = kwargs.get(key)
        if value is None:
            continue
        ids = value if key == "device_ids" else [value]
        if not (isinstance(ids, (list, tuple)) and len(ids) == 1
                and _same_device(ids[0], device)):
            hint = ("leave it None for a module on the CPU, as torch DDP requires"
                    if device.type == "cpu" else f"the module is on {device}")
            raise UsageError(f"DataParallel: {key}={value!r} does not name the module's one "
                             f"device; {hint}")
    if kwargs.get("dim", 0) != 0:
        raise UsageError(f"DataParallel: dim={kwargs['dim']!r}; only 0 (each rank is fed its "
                         "own batch, nothing is scattered)")
    if kwargs.get("init_sync", True) is not True:
        raise UsageError("DataParallel: init_sync=False is not supported; rank 0's parameters "
                         "and buffers are always broadcast at construction")
    return group


def comm_hook_reduction(state, hook):
    """torch DDP's built-in communication hooks as the gradsync reduction doing the same.

    ``allreduce_hook``: the default (None); ``fp16_compress_hook`` / ``bf16_compress_hook``:
    16-bit wire format (``compress.HalfPrecisionCompressor``: a float32 sum in rank
    order of the rounded inputs, where torch's all-reduce rounds at every hop);
    ``powerSGD_hook`` with its ``PowerSGDState``: ``compress.PowerSGDCompressor`` with
    the state's rank, minimum compression rate, error feedback, warm start and epsilon,
    exact for the state's ``start_powerSGD_iter`` first synchronised steps. Any other
    hook is a one-line error: gradsync's buckets are not torch ``GradBucket`` objects.
    """
    if hook is default_hooks.allreduce_hook:
        return None
    if hook is default_hooks.fp16_compress_hook:
        return CompressedBuckets(HalfPrecisionCompressor("fp16"))
    if hook is default_hooks.bf16_compress_hook:
        return CompressedBuckets(HalfPrecisionCompressor("bf16"))
    if hook is psgd.powerSGD_hook:
        if not isinstance(state, psgd.PowerSGDState):
            raise UsageError("register_comm_hook(state, powerSGD_hook) needs a PowerSGDState, "
                             f"got {type(state).__name__}")
        compressor = PowerSGDCompressor(
            rank=state.matrix_approximation_rank, min_compression_rate=state.min_compression_rate,
            use_error_feedback=state.use_error_feedback, warm_start=state.warm_start,
            orthogonalization_epsilon=state.orthogonalization_epsilon)
        return CompressedBuckets(compressor, exact_windows=max(1, state.start_powerSGD_iter))
    name = getattr(hook, "__qualname__", repr(hook))
    raise UsageError(
        f"register_comm_hook: {name} is not one of torch's built-in hooks gradsync maps "
        "(allreduce_hook, fp16_compress_hook, bf16_compress_hook, powerSGD_hook); pass "
        "DataParallel(reduction=gradsync.CompressedBuckets(gradsync.parse_compression(...))) "
        "or a gradsync.engine.buckets.reduction.BucketReduction of your own")


class DDPMethods:
    """torch DDP's methods and attributes that a switching user's code calls."""

    def register_comm_hook(self, state, hook) -> None:
        """torch DDP's communication hooks, mapped (:func:`comm_hook_reduction`)."""
        reduction = comm_hook_reduction(state, hook)
        if reduction is not None:
            self.set_reduction(reduction)

    @property
    def require_backward_grad_sync(self) -> bool:
        """DDP's flag behind ``no_sync()``; some trainers set it directly."""
        return self._require_sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self._require_sync = bool(value)

    def _rewrap_kwargs(self, what: str) -> dict:
        """The settings that wrap a copy of the module again (deepcopy, pickling): the
        bucket cap 'auto' chose, not 'auto'. A custom reduction (ZeRO, a comm hook,
        compression) or reference collectives keep state of this process: refused."""
        if self._custom_reduction or self.collectives != "native":
            raise UsageError(f"{what} of a DataParallel with a custom reduction (ZeRO, a comm "
                             "hook, compression) or reference collectives is not supported: "
                             "copy or save model.module and wrap it on every rank")
        kwargs = dict(self._init_kwargs)
        if kwargs["bucket_cap_mb"] == "auto":
            kwargs["bucket_cap_mb"] = self.bucket_cap_bytes / 2**20
        return kwargs

    def __deepcopy__(self, memo):
        """A working copy, as torch DDP's: the module deep-copied and wrapped again on the
        same process group and settings. No collectives (the copy is of a replica
        already in sync), so one rank may copy alone, e.g. for an EMA or an evaluation
        model; training the copy synchronises it like the original."""
        kwargs = self._rewrap_kwargs("deepcopy")
        return type(self)(copy.deepcopy(self.module, memo), _in_sync=True, **kwargs)

    def __reduce_ex__(self, protocol):
        """Pickling (``torch.save(model)``), as torch DDP's: the module and the settings
        travel; unpickling wraps the module again on the default process group, which
        must be initialised then (``gs.init()``)."""
        kwargs = self._rewrap_kwargs("pickling")
        group = kwargs.pop("group")
        kwargs.pop("process_group", None)
        if group not in (None, torch.distributed.group.WORLD):
            raise UsageError("a gradsync DataParallel on a process group other than the "
                             "default cannot be pickled: save model.module, or "
                             "model.state_dict()")
        return _unpickle_data_parallel, (type(self), self.module, kwargs)


def _unpickle_data_parallel(cls, module, kwargs):
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        raise UsageError("unpickling a gradsync DataParallel wraps its module on the default "
                         "process group: call gradsync.init() first (or save model.module)")
    return cls(module, _in_sync=True, **kwargs)

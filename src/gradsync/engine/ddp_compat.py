"""torch DDP's constructor keywords, accepted by DataParallel where they mean something here.

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
* ``static_graph``: accepted, either value; nothing needs the hint (buckets are
  rebuilt once in the observed order; unused parameters follow
  ``find_unused_parameters``).
* ``init_sync``: True only: rank 0's state is always broadcast at construction.

Anything else is a TypeError, as for any unknown keyword.
"""

from __future__ import annotations

import torch

from ..errors import UsageError

DDP_KEYWORDS = ("process_group", "device_ids", "output_device", "dim",
                "gradient_as_bucket_view", "static_graph", "init_sync")


def _same_device(value, device: torch.device) -> bool:
    if isinstance(value, int) and not isinstance(value, bool):
        return device.type != "cpu" and device.index == value
    try:
        return torch.device(value) == device
    except (TypeError, RuntimeError):
        return False


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

"""Which of the three guarantees a run's synchronisation gives, from its config.json.

* ``exact``: ``--sync exact`` without ``--compress``: every step's gradient is the
  exact mean over every item of the global batch; replicas identical always.
* ``compressed``: ``--sync exact --compress X``: gradients are summed through a
  compressor (error feedback keeps what it drops for the next step), so the
  update is close to, not equal to, the exact one; replicas stay identical
  (every rank applies the same decompressed sum).
* ``local``: ``--sync diloco | streaming-diloco``: workers step on their own
  items and replicas differ between syncs by design.

The report words its exactness section, its captions and its drift line by this;
train's closing table describes the same runs through ``rundir.sync_description``.
"""

from __future__ import annotations

EXACT, COMPRESSED, LOCAL = "exact", "compressed", "local"


def sync_mode(config: dict) -> str:
    if config.get("sync", "exact") in ("diloco", "streaming-diloco"):
        return LOCAL
    return COMPRESSED if config.get("compress", "none") not in ("none", None) else EXACT


def compressor_text(spec: str) -> str:
    """``--compress`` in words (engine/compress: the codecs and their error feedback)."""
    name, _, arg = str(spec).lower().partition(":")
    if name in ("bf16", "fp16"):
        return (f"{name}: every hop carries 16-bit values, the sums are taken at full "
                "precision, no error feedback")
    if name == "int8":
        return (f"int8: blockwise 8-bit quantisation, one scale per block of "
                f"{arg or 256} elements, with error feedback")
    if name == "powersgd":
        return (f"PowerSGD of rank {arg or 1}: each gradient matrix sent as two thin "
                "factors, with error feedback")
    return str(spec)


def first_drift_check(config: dict) -> int | None:
    """The step of a run's first replica check, if before its end (train/records/instrument.py):
    every ``--drift-every`` steps; DiLoCo after each sync (every ``--sync-every``);
    streaming DiLoCo only at the end (None); ``--drift-every 0`` or zero3 never (None);
    a synchronous warm-up (``--sync-warmup``) from step 1."""
    every = config.get("drift_every", 1)
    if not every or config.get("strategy") == "zero3":
        return None
    method = config.get("sync", "exact")
    if config.get("sync_warmup") and method in ("diloco", "streaming-diloco"):
        return 1  # the synchronous warm-up's steps leave one model
    if method == "streaming-diloco":
        return None
    return int(config.get("sync_every") or 1) if method == "diloco" else int(every)


def sync_schedule(config: dict) -> str:
    """When a local-update run syncs, in words: the interval, and the warm-up or the
    growing interval when the run has them (``--sync-warmup``, ``--sync-every-max``)."""
    h, w, m = config.get("sync_every", "?"), config.get("sync_warmup"), config.get(
        "sync_every_max")
    every = (f"every {h} to {m} steps, further apart as the learning rate decays" if m
             else f"every {h} steps")
    return f"synchronous for the first {w} steps, then syncs {every}" if w else f"syncs {every}"

"""Flags that only mean something in one mode: refused, naming the flag that enables them.

``--sync-every 10`` without ``--sync diloco`` used to be accepted and ignored, so a
run the user believed was DiLoCo every 10 steps was exact synchronous training.
Each flag below belongs to a mode; given while that mode is off it is refused, in
one line, before any worker starts.

"Given" is read from the value: a TrainConfig field is a dataclass default, and a
flag set to its default cannot be told apart from one left out (both in the CLI and
in ``gs.train(sync_every=25)``). So the rule is: a mode flag whose value differs
from its default while its mode is off is refused; one equal to the default passes
(it changes nothing either way). A value that *turns the feature off* is accepted
in any mode (``--probe-every 0``: never probe, true of an uncompressed run too).

Which flag belongs to which mode (decided here, documented in docs/train.md):

* ``--sync-every``, ``--outer-lr``, ``--outer-momentum``, ``--sync-warmup``,
  ``--outer-momentum-warmup``: ``--sync diloco`` or ``streaming-diloco``;
* ``--sync-every-max``: ``--sync diloco`` (streaming's staggered fragments assume one H);
* ``--fragments``, ``--sync-delay``, ``--sync-alpha``, ``--sync-eager``: ``--sync
  streaming-diloco``;
* ``--probe-every``, ``--compress-delay``: ``--compress`` with ``--sync exact`` (the probe
  sums the exact gradient beside the compressed one; DiLoCo's compressed pseudo-gradient
  has none, nor gradient buckets to delay);
* ``--balance auto``: ``--sync exact`` without ``--compress`` (only an exact gradient
  can be split by speed and stay the same update);
* ``--baseline-steps``: ``--baseline``.

``--straggler`` is not on the list: it emulates slow workers in every mode (how
DiLoCo or a compressor copes with one is a fair question), with or without
``--balance``.
"""

from __future__ import annotations

from dataclasses import fields

from ...errors import UsageError

_LOCAL = ("diloco", "streaming-diloco")
OFF_VALUES = {"probe_every": 0, "compress_delay": 0}
"""Values that switch a feature off, accepted whatever the mode."""


def _rules(cfg) -> list[tuple[str, bool, str, str]]:
    """(field, its mode is on, the flag(s) that turn it on, what this run has instead)."""
    exact = cfg.sync == "exact"
    compressed = cfg.compress != "none"
    sync = f"--sync {cfg.sync}"
    both = sync + (f" --compress {cfg.compress}" if compressed else " and no --compress")
    local = "--sync diloco or --sync streaming-diloco"
    return [
        ("sync_every", cfg.sync in _LOCAL, local, sync),
        ("outer_lr", cfg.sync in _LOCAL, local, sync),
        ("outer_momentum", cfg.sync in _LOCAL, local, sync),
        ("sync_warmup", cfg.sync in _LOCAL, local, sync),
        ("outer_momentum_warmup", cfg.sync in _LOCAL, local, sync),
        ("sync_every_max", cfg.sync == "diloco", "--sync diloco", sync),
        ("sync_eager", cfg.sync == "streaming-diloco", "--sync streaming-diloco", sync),
        ("fragments", cfg.sync == "streaming-diloco", "--sync streaming-diloco", sync),
        ("sync_delay", cfg.sync == "streaming-diloco", "--sync streaming-diloco", sync),
        ("sync_alpha", cfg.sync == "streaming-diloco", "--sync streaming-diloco", sync),
        ("probe_every", exact and compressed,
         "--compress (bf16, fp16, int8, powersgd:R) with --sync exact", both),
        ("compress_delay", exact and compressed,
         "--compress (bf16, fp16, int8, powersgd:R) with --sync exact", both),
        ("balance", exact and not compressed, "--sync exact without --compress", both),
        ("baseline_steps", bool(cfg.baseline), "--baseline", "no --baseline"),
    ]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_mode_flags(cfg) -> None:
    """Raise one UsageError for the first mode flag given while its mode is off."""
    defaults = {f.name: f.default for f in fields(cfg)}
    for name, enabled, needs, now in _rules(cfg):
        value = getattr(cfg, name)
        if enabled or value == defaults[name] or OFF_VALUES.get(name) == value:
            continue
        raise UsageError(f"{_flag(name)} {value} has no effect with {now}: it needs {needs}; "
                         f"add that, or drop {_flag(name)}")

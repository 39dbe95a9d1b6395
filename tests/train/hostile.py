"""Files crafted the way an attacker would craft them, for the tests of issue 34.

A run directory may come from someone else. Whoever writes a checkpoint also writes
its checksums (the zip's CRC-32s, the tensors' CRC-32s, the unit record's and the
manifest's SHA-256s), so a crafted file passes every integrity check: these helpers
plant a pickle whose unpickling calls ``exec`` -- creating a marker file -- and then
rewrite every checksum to match, as an attacker would. A test that finds the marker
has caught gradsync running code from a file.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path

import torch


class Payload:
    """Unpickled, it runs ``open(marker, 'w')`` through ``exec``: code from a file."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').close()",))


def _load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)  # gradsync's own: plain data


def plant_in_checkpoint(run: Path, marker: Path) -> Path:
    """``run/checkpoint.pt`` with one extra key holding :class:`Payload`; its zip CRCs,
    tensor digests and unit record are all as valid as before."""
    path = run / "checkpoint.pt"
    state = _load(path)
    state["note"] = Payload(marker)
    torch.save(state, path)
    return path


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def plant_in_shard(run: Path, marker: Path) -> Path:
    """A ZeRO shard file of ``run`` with :class:`Payload` added, and every checksum that
    covers it rewritten: the manifest's size and SHA-256 of the file, and the unit
    record's SHA-256s of the file and of the manifest in ``checkpoint.pt``."""
    ckpt = run / "checkpoint.pt"
    state = _load(ckpt)
    root = run / state["optimizer_shards"]
    shard = sorted(root.glob("shard-*.pt"))[-1]
    payload = _load(shard)
    payload["note"] = Payload(marker)
    buf = io.BytesIO()
    torch.save(payload, buf)
    data = buf.getvalue()
    shard.write_bytes(data)
    manifest_path = root / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"][shard.name] = {"bytes": len(data), "sha256": _sha(data)}
    manifest_path.write_text(json.dumps(manifest, indent=1))
    files = state["unit"]["shards"]["files"]
    files[shard.name] = _sha(data)
    files["manifest.json"] = _sha(manifest_path.read_bytes())
    torch.save(state, ckpt)
    return shard


def evil_factory(directory: Path, marker: Path) -> str:
    """``directory/evil.py`` whose import creates ``marker``; returns its factory spec."""
    path = directory / "evil.py"
    path.write_text(f"open({str(marker)!r}, 'w').close()\n\n"
                    "def build():\n    import torch\n    return torch.nn.Linear(6, 3)\n")
    return f"{path}:build"


def ran(marker: Path) -> bool:
    return os.path.exists(marker)

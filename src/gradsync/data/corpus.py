"""A built-in text corpus that needs no network: the Python standard library.

``gradsync train`` must work offline on a fresh machine, and every installed
Python carries a few megabytes of real, varied text in its standard library
sources. Byte-level tokens (vocabulary 256) need no tokenizer files either.
The corpus is deterministic for a given Python install (sorted path order), so
every rank reads the same tokens without any communication, and nothing is
cached on disk.
"""

from __future__ import annotations

import os
import sysconfig

import torch
from torch.utils.data import Dataset

VOCAB_SIZE = 256
DEFAULT_MAX_BYTES = 4 * 1024 * 1024
SKIP_DIRS = frozenset({"test", "tests", "idlelib", "site-packages", "lib2to3", "__pycache__"})


def stdlib_files(root: str | None = None) -> list[str]:
    """Sorted ``*.py`` paths under the stdlib, skipping tests and vendored trees."""
    root = root or sysconfig.get_paths()["stdlib"]
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        found.extend(os.path.join(dirpath, f) for f in filenames if f.endswith(".py"))
    return sorted(found)


def stdlib_bytes(max_bytes: int = DEFAULT_MAX_BYTES, root: str | None = None) -> bytes:
    """Concatenated stdlib sources, truncated to ``max_bytes``.

    Files are read as bytes (they are UTF-8 by PEP 3120), which keeps this
    fast and immune to locale settings.
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    parts: list[bytes] = []
    size = 0
    for path in stdlib_files(root):
        with open(path, "rb") as f:
            data = f.read(max_bytes - size)
        parts.append(data)
        size += len(data)
        if size >= max_bytes:
            break
    if size == 0:
        raise RuntimeError(f"no Python sources found under {root or 'the stdlib'}")
    return b"".join(parts)


def stdlib_tokens(max_bytes: int = DEFAULT_MAX_BYTES, root: str | None = None) -> torch.Tensor:
    """Byte-level tokens of the stdlib corpus as a 1-D ``torch.uint8`` tensor."""
    data = bytearray(stdlib_bytes(max_bytes, root))
    return torch.frombuffer(data, dtype=torch.uint8).clone()


def random_tokens(n_tokens: int, seed: int = 0, vocab_size: int = VOCAB_SIZE) -> torch.Tensor:
    """Uniform random tokens (int64) for benchmarks, where content does not matter."""
    g = torch.Generator()
    g.manual_seed(seed)
    return torch.randint(0, vocab_size, (n_tokens,), generator=g, dtype=torch.int64)


class TokenWindows(Dataset):
    """Non-overlapping windows of ``seq_len + 1`` tokens as (x, y) pairs.

    Window ``i`` is ``tokens[i*(seq_len+1) : (i+1)*(seq_len+1)]``; ``y`` is
    ``x`` shifted by one (next-token targets). Windows share no token, so a
    partition of window indices (the sampler's guarantee) is also a partition
    of the tokens: no token is trained on twice in an epoch. Tail tokens that do
    not fill a window are left out.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        n = tokens.numel() // (seq_len + 1)
        if n < 1:
            raise ValueError(
                f"{tokens.numel()} tokens is too few for one window of seq_len={seq_len}"
            )
        self.tokens = tokens
        self.seq_len = seq_len
        self._n = n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not -self._n <= i < self._n:
            raise IndexError(f"window {i} out of range for {self._n} windows")
        i %= self._n
        start = i * (self.seq_len + 1)
        chunk = self.tokens[start : start + self.seq_len + 1].to(torch.int64)
        return chunk[:-1], chunk[1:]

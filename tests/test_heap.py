"""Workers keep freed heap memory: a freed multi-MB block is reused, not re-faulted.

Stage 3 frees and re-allocates every unit's gathered parameters and gradient each
step. With glibc's defaults such blocks are ``mmap``-ed and returned to the kernel
on ``free``, so each re-allocation comes back as fresh zero-filled pages
(docs/zero.md: thousands of page faults per stage-3 step, about 9% of its time).
``gradsync.heap.keep_freed_memory`` is applied by the launcher to every worker.
Checked here with glibc's own ``malloc``, so the test measures the allocator
setting alone (how many of torch's allocations hit the pattern depends on
allocation order; the step-level effect is a benchmark figure, not a test).
"""

import ctypes

import pytest

import gradsync as gs

MIB = 30  # below the raised mmap threshold (32 MiB), far above glibc's default (128 KiB)


def _refaulted_pages() -> int:
    """Minor page faults when a freed block of MIB is allocated and touched again."""
    import resource

    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    size = MIB * 2**20
    faults = []
    for _ in range(2):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        block = libc.malloc(size)
        libc.memset(block, 1, size)
        libc.free(block)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return faults[1]


@pytest.mark.parametrize("setting", ["1", "0"])
def test_workers_reuse_freed_blocks_unless_turned_off(setting, monkeypatch):
    monkeypatch.setenv("GRADSYNC_KEEP_FREED_MEMORY", setting)
    faults = gs.spawn(_refaulted_pages, 2)
    pages = MIB * 2**20 // 4096
    if setting == "1":
        assert max(faults) < pages // 100, (faults, pages)  # the block stayed in the heap
    else:  # glibc's defaults: munmap on free, fresh pages on the next malloc
        assert min(faults) > pages // 2, (faults, pages)

"""The process's freed heap: given back to the operating system, or kept for the next step.

Where the trainer shares its devices with generation (`workflow.placement` colocated or
hybrid), its step ends with a switch to the other task; on a CPU host the memory the
step freed stays in the C allocator's free lists (resident, counted against the node)
unless it is returned. glibc's `malloc_trim(0)` returns the free pages of every arena.

Where it has its devices to itself, the opposite: each step allocates and frees the
same activations again, and glibc by default serves blocks above a (self-adjusting)
size from fresh mappings and shrinks the heap's top once enough of it is free, so
every step faults the same pages in again and the kernel zeroes them: on a small model
about a tenth of the step's CPU time. `keep_heap` keeps those blocks in the heap and the
heap's free top in the process. The built-in inference server on CPU keeps its heap as
well (its running batch's KV buffers are made anew at each merge of new requests) and
trims it when asked to release its memory. Elsewhere (another C library) both are
no-ops."""

from __future__ import annotations

import ctypes
import ctypes.util
from functools import cache
from typing import Any

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# blocks up to this size come from the heap (glibc's largest allowed on 64-bit)
KEEP_MMAP_THRESHOLD = 32 * 2**20
# free memory at the heap's top kept for the next step, beyond which the top is returned
KEEP_TRIM_THRESHOLD = 512 * 2**20


@cache
def _libc_function(name: str) -> Any | None:
    lib = ctypes.util.find_library("c")
    if lib is None:
        return None
    try:
        libc = ctypes.CDLL(lib)
    except OSError:
        return None
    return getattr(libc, name, None)


def trim_heap() -> bool:
    """Return the freed heap to the OS; False where the C library cannot."""
    trim = _libc_function("malloc_trim")
    if trim is None:
        return False
    trim(0)
    return True


def keep_heap(
    mmap_threshold: int = KEEP_MMAP_THRESHOLD, trim_threshold: int = KEEP_TRIM_THRESHOLD
) -> bool:
    """Serve blocks up to `mmap_threshold` bytes from the heap and keep up to
    `trim_threshold` free bytes at its top; False where the C library cannot."""
    mallopt = _libc_function("mallopt")
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(
        mallopt(_M_TRIM_THRESHOLD, trim_threshold)
    )

"""Give the process's freed heap back to the operating system.

Where the trainer shares its devices with generation (`workflow.placement` colocated or
hybrid), its step ends with a switch to the other task; on a CPU host the memory the
step freed stays in the C allocator's free lists (resident, counted against the node)
unless it is returned. glibc's `malloc_trim(0)` returns the free pages of every arena.
Elsewhere (another C library) this is a no-op."""

from __future__ import annotations

import ctypes
import ctypes.util
from functools import cache
from typing import Any


@cache
def _malloc_trim() -> Any | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    return getattr(libc, "malloc_trim", None)


def trim_heap() -> bool:
    """Return the freed heap to the OS; False where the C library cannot."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True

"""The trainer gives its freed heap back between steps where it shares devices."""

from __future__ import annotations

import os
import sys

import pytest

from areal_hex.heap import trim_heap


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and /proc")
def test_freed_heap_below_a_live_block_goes_back_to_the_os() -> None:
    # 100 KiB blocks sit in the heap (below glibc's mmap threshold); the last one stays
    # alive, so the heap's top cannot shrink and only a trim returns the freed pages
    blocks = [bytearray(100 * 1024) for _ in range(1500)]
    keep = blocks[-1]
    before = _rss_bytes()
    del blocks
    freed = _rss_bytes()
    assert trim_heap() is True
    after = _rss_bytes()
    assert before - freed < 32 * 2**20  # free() alone keeps most of it resident
    assert freed - after > 100 * 2**20  # the trim returns it
    assert len(keep) == 100 * 1024


_REFAULTS = """
import resource, sys
from areal_hex.heap import keep_heap
if sys.argv[1] == "keep":
    assert keep_heap() is True
def cycle():  # a step's activations: 48 blocks of 1 MiB, written, then all freed
    blocks = [bytearray(2**20) for _ in range(48)]
    for b in blocks:
        b[::4096] = b"x" * len(b[::4096])
for _ in range(2):
    cycle()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
cycle()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and /proc")
def test_kept_heap_serves_the_next_step_without_faulting_its_pages_in_again() -> None:
    import subprocess

    def faults(mode: str) -> int:
        run = [sys.executable, "-c", _REFAULTS, mode]
        return int(subprocess.run(run, capture_output=True, text=True, check=True).stdout)

    pages = 48 * 2**20 // os.sysconf("SC_PAGE_SIZE")
    assert faults("default") > pages // 2  # glibc hands the freed top back each time
    assert faults("keep") < pages // 20

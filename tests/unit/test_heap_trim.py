"""The trainer gives its freed heap back between steps where it shares devices."""

from __future__ import annotations

import os
import sys

import pytest

from trainer_service.heap import trim_heap


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

"""What `freeze_startup` promises: what is alive at start-up leaves the collector's scans,
and what is made afterwards is still collected."""

from __future__ import annotations

import gc
import weakref

from areal_hex.gc_freeze import freeze_startup


class _Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the collector frees it


def test_startup_objects_frozen_later_cycles_collected() -> None:
    try:
        before = _Node()
        freeze_startup()
        assert gc.get_freeze_count() > 0
        frozen_ref = weakref.ref(before)
        del before
        gc.collect()
        assert frozen_ref() is not None  # frozen: a full collection leaves it alone
        after = _Node()
        later_ref = weakref.ref(after)
        del after
        gc.collect()
        assert later_ref() is None  # made after the freeze: collected as usual
    finally:
        gc.unfreeze()


def test_collection_deferred_until_the_freeze() -> None:
    """`defer_collection` turns automatic collection off for the start; `freeze_startup`
    turns it on again."""
    from areal_hex.gc_freeze import defer_collection

    try:
        defer_collection()
        assert not gc.isenabled()
        freeze_startup()
        assert gc.isenabled()
    finally:
        gc.enable()
        gc.unfreeze()

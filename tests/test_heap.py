"""The heap planning frees is handed back (NOTE [ Planning's freed heap ]): the block's
reference cycles are collected, the objects from before it are not walked, and a caller's own
`gc.freeze()` is left as it was."""

import gc
import sys
import weakref

import pytest

from hbp.runtime.heap import heap_returned_after

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")


class _Node:
    pass


def _garbage_cycle() -> weakref.ref:
    node = _Node()
    node.self = node
    return weakref.ref(node)


@pytest.fixture
def no_automatic_gc():
    gc.collect()
    gc.disable()
    yield
    gc.enable()


def test_the_blocks_cycles_are_collected_and_older_objects_are_not_walked(no_automatic_gc):
    before = _garbage_cycle()
    with heap_returned_after():
        inside = _garbage_cycle()
        assert inside() is not None
    assert inside() is None  # collected at the block's end
    assert before() is not None  # frozen while the block ran: not walked
    assert gc.get_freeze_count() == 0  # unfrozen again
    gc.collect()
    assert before() is None


def test_a_callers_freeze_is_kept(no_automatic_gc):
    gc.freeze()
    try:
        assert gc.get_freeze_count() > 0
        with heap_returned_after():
            inside = _garbage_cycle()
        assert inside() is None
        # still frozen (the count itself drops as frozen objects die by reference counting)
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def test_the_block_is_collected_when_it_raises(no_automatic_gc):
    refs = []
    with pytest.raises(ValueError), heap_returned_after():
        refs.append(_garbage_cycle())
        raise ValueError("a BudgetError, say")
    assert refs[0]() is None
    assert gc.get_freeze_count() == 0

import gc
import weakref

import pytest

from memfit.planning.paused_gc import paused_gc


class _Cyclic:
    """An object in a reference cycle with itself: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


def _cycle() -> weakref.ref:
    return weakref.ref(_Cyclic())


@pytest.fixture(autouse=True)
def _collector_enabled():
    """Each test starts with the collector on and leaves it as it found it, whatever the test
    did to it: a collector left off would pause collection for every later test in the same
    worker (``test_runner`` checks that timing restores it)."""
    was = gc.isenabled()
    gc.enable()
    yield
    if was:
        gc.enable()
    else:
        gc.disable()


def test_paused_inside_and_the_sections_cycles_collected_at_its_end() -> None:
    with paused_gc():
        assert not gc.isenabled()
        dead = _cycle()
        assert dead() is not None
    assert gc.isenabled()
    assert dead() is None  # freed by the section's own collection, not by a later one


def test_a_nested_section_collects_its_own_cycles_and_keeps_the_collector_paused() -> None:
    with paused_gc():
        with paused_gc():
            inner = _cycle()
        assert inner() is None
        assert not gc.isenabled()
    assert gc.isenabled()


def test_resumed_after_an_error() -> None:
    with pytest.raises(ValueError), paused_gc():
        raise ValueError("planning failed")
    assert gc.isenabled()


def test_a_collector_the_caller_disabled_stays_disabled_and_collects_nothing() -> None:
    gc.disable()
    with paused_gc():
        dead = _cycle()
    assert not gc.isenabled()
    assert dead() is not None
    gc.collect()
    assert dead() is None

"""A simulation runs under the aggregator service's garbage-collector policy and gives the
caller's back."""

from __future__ import annotations

import gc

from vigil.aggregator.app import GC_THRESHOLDS
from vigil.sim.run import service_gc


def test_the_services_thresholds_and_freeze_then_the_callers_again() -> None:
    before = gc.get_threshold()
    gc.unfreeze()  # a caller that froze nothing
    with service_gc():
        assert gc.get_threshold() == GC_THRESHOLDS != before
        assert gc.get_freeze_count() > 0
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0


def test_what_the_caller_froze_stays_frozen() -> None:
    gc.freeze()
    try:
        with service_gc():
            pass
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()

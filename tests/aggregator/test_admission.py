"""Admission control (aggregator/admission.py) on an injected clock: each reason sheds past its
bound with its status and Retry-After, and the lookalikes under it (a queue just under the bound,
a lag at the bound, a rate within the bucket, a node heard from lately) take every report."""

from __future__ import annotations

from vigil.aggregator.admission import Admission, AdmissionConfig


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def admission(**config: float) -> tuple[Admission, FakeClock]:
    clock = FakeClock()
    return Admission(AdmissionConfig.model_validate(config), clock), clock


def test_defaults_take_a_report_of_an_aggregator_that_keeps_up() -> None:
    a, clock = admission()
    clock.now += 3600
    assert a.check(held=24_999, loop_lag_seconds=2.0) is None


def test_a_full_queue_of_held_reports_sheds_with_503_and_retry_after() -> None:
    a, _ = admission(max_held_reports=100, retry_after_seconds=7)
    assert a.check(held=99, loop_lag_seconds=0.0) is None
    shed = a.check(held=100, loop_lag_seconds=0.0)
    assert shed is not None and (shed.reason, shed.status, shed.retry_after_seconds) == ("held_full", 503, 7)
    assert "max_held_reports" in shed.detail


def test_a_late_event_loop_sheds_and_one_at_the_bound_does_not() -> None:
    a, _ = admission(max_loop_lag_seconds=1.0)
    assert a.check(held=0, loop_lag_seconds=1.0) is None
    shed = a.check(held=0, loop_lag_seconds=1.01)
    assert shed is not None and (shed.reason, shed.status) == ("loop_lag", 503)


def test_the_rate_bound_takes_a_second_of_burst_then_sheds_with_429_until_tokens_refill() -> None:
    a, clock = admission(max_reports_per_second=10, retry_after_seconds=2)
    assert all(a.check(held=0, loop_lag_seconds=0.0) is None for _ in range(10))
    shed = a.check(held=0, loop_lag_seconds=0.0)
    assert shed is not None and (shed.reason, shed.status, shed.retry_after_seconds) == ("rate", 429, 2)
    clock.now += 0.1  # one token back
    assert a.check(held=0, loop_lag_seconds=0.0) is None
    assert a.check(held=0, loop_lag_seconds=0.0) is not None
    clock.now += 100.0  # a long quiet spell refills one second's worth, no more
    assert sum(a.check(held=0, loop_lag_seconds=0.0) is None for _ in range(20)) == 10


def test_a_rate_under_one_a_second_still_takes_one_report_and_asks_for_the_wait_it_needs() -> None:
    a, clock = admission(max_reports_per_second=0.1, retry_after_seconds=1)
    assert a.check(held=0, loop_lag_seconds=0.0) is None
    shed = a.check(held=0, loop_lag_seconds=0.0)
    assert shed is not None and shed.retry_after_seconds == 10
    clock.now += 10.0
    assert a.check(held=0, loop_lag_seconds=0.0) is None


def test_a_node_quiet_for_always_admit_after_seconds_is_taken_whatever_the_load_but_not_past_the_held_bound() -> None:
    a, _ = admission(max_loop_lag_seconds=1.0, max_held_reports=10, always_admit_after_seconds=10)
    assert a.check(held=0, loop_lag_seconds=5.0, quiet_seconds=lambda: 10.0) is None
    shed = a.check(held=0, loop_lag_seconds=5.0, quiet_seconds=lambda: 9.9)  # the lookalike: heard from lately
    assert shed is not None and shed.reason == "loop_lag"
    assert a.check(held=0, loop_lag_seconds=5.0, quiet_seconds=lambda: None) is not None  # unknown: shed
    full = a.check(held=10, loop_lag_seconds=0.0, quiet_seconds=lambda: 3600.0)
    assert full is not None and full.reason == "held_full"  # memory's bound holds for everyone


def test_one_stall_of_the_event_loop_sheds_nothing_and_a_lag_that_lasts_does() -> None:
    # A busy host's single 3.5 s hiccup (seen in a clock-step test on a loaded machine) must not
    # shed the reports queued behind it; two late timers in a row are a lag that lasts.
    a, _ = admission()
    a.note_loop_lag(3.5)
    assert a.check(held=0, loop_lag_seconds=a.loop_lag_seconds) is None
    a.note_loop_lag(0.01)
    assert a.check(held=0, loop_lag_seconds=a.loop_lag_seconds) is None
    a.note_loop_lag(2.5)
    a.note_loop_lag(3.0)
    shed = a.check(held=0, loop_lag_seconds=a.loop_lag_seconds)
    assert shed is not None and shed.reason == "loop_lag" and "2.50s late" in shed.detail
    a.note_loop_lag(0.0)
    assert a.check(held=0, loop_lag_seconds=a.loop_lag_seconds) is None

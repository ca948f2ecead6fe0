"""The training collector's application signals, restarts and checkpoints: what each new rank
summary field says for a window of heartbeats, and the per-rank series an operator reads."""

from __future__ import annotations

import json

import pytest

from tests.agent.collectors.test_training import T0, FakeProcesses, make, summary_of, value
from vigil.agent.attribution import IN_PROCESS, Sender
from vigil.contract.wire import Report, check, decode_report, encode

JR = {"job": "j1", "rank": "0"}


def beat(step: int, **fields: object) -> bytes:
    return json.dumps({"job": "j1", "rank": 0, "step": step, "step_seconds": 1.0, **fields}).encode()


def feed(c, beats: list[tuple[float, bytes]], sender: Sender = IN_PROCESS) -> None:
    for at, payload in beats:
        assert c.ingest(payload, T0 + at, sender) is None


def test_loss_and_gradient_norm_of_the_window():
    c = make()
    losses = [2.0, 1.9, 2.4, 1.8]
    norms = [0.5, 0.9, 3.0, 0.7]
    feed(c, [(i, beat(10 + i, loss=loss, grad_norm=norm))
             for i, (loss, norm) in enumerate(zip(losses, norms, strict=True))])
    col = c.collect(T0 + 5)
    s = summary_of(col, "j1", 0)
    assert s.loss_p50 == pytest.approx(1.95) and s.loss_last == 1.8
    assert s.grad_norm_p50 == pytest.approx(0.8) and s.grad_norm_max == 3.0
    assert (s.nonfinite_steps, s.nonfinite_first_step) == (0, None)
    assert value(col.samples, "vigil_training_loss", **JR) == 1.8
    assert value(col.samples, "vigil_training_grad_norm", **JR) == 0.7
    assert value(col.samples, "vigil_training_nonfinite_steps_total", **JR) == 0


def test_nan_only_in_the_gradient_norm_is_a_nonfinite_step():
    c = make()
    feed(c, [(0, beat(10, loss=2.0, grad_norm=0.5)), (1, beat(11, loss=2.1, grad_norm="nan")),
             (2, beat(12, loss=2.2, grad_norm="inf"))])
    col = c.collect(T0 + 5)
    s = summary_of(col, "j1", 0)
    assert (s.nonfinite_steps, s.nonfinite_first_step, s.nonfinite_loss_steps) == (2, 11, 0)
    assert s.loss_last == 2.2 and s.grad_norm_max == 0.5  # the finite ones only
    assert value(col.samples, "vigil_training_grad_norm", **JR) == 0.5  # the latest finite
    assert value(col.samples, "vigil_training_nonfinite_steps_total", **JR) == 2


def test_a_nan_loss_window_has_no_loss_figures_but_counts_every_step():
    c = make()
    feed(c, [(i, beat(20 + i, loss="nan", grad_norm="nan")) for i in range(3)])
    s = summary_of(c.collect(T0 + 5), "j1", 0)
    assert (s.loss_p50, s.loss_last, s.grad_norm_p50, s.grad_norm_max) == (None, None, None, None)
    assert (s.nonfinite_steps, s.nonfinite_first_step, s.nonfinite_loss_steps) == (3, 20, 3)


def test_a_loss_that_turns_nan_after_finite_steps_counts_its_nan_steps_apart():
    c = make()
    feed(c, [(0, beat(30, loss=2.0)), (1, beat(31, loss=2.1)), (2, beat(32, loss="nan")), (3, beat(33, loss="inf"))])
    s = summary_of(c.collect(T0 + 5), "j1", 0)
    assert s.loss_last == 2.1 and (s.nonfinite_steps, s.nonfinite_loss_steps, s.nonfinite_first_step) == (2, 2, 32)


def test_a_window_without_signals_leaves_the_fields_out():
    c = make()
    feed(c, [(0, beat(1)), (1, beat(2))])
    col = c.collect(T0 + 5)
    s = summary_of(col, "j1", 0)
    assert (s.loss_p50, s.grad_norm_max, s.nonfinite_steps, s.nonfinite_first_step) == (None, None, 0, None)
    assert s.first_step == 1
    assert value(col.samples, "vigil_training_nonfinite_steps_total", **JR) is None  # no signals, no series
    assert b"loss" not in encode(s) and b"nonfinite" not in encode(s)


def test_signals_outside_the_complete_window_are_not_summarised():
    c = make()
    feed(c, [(1, beat(10, loss=2.0)), (6, beat(11, loss="nan"))])  # the second is in the next window
    s = summary_of(c.collect(T0 + 7), "j1", 0)
    assert (s.loss_last, s.nonfinite_steps) == (2.0, 0)
    s = summary_of(c.collect(T0 + 10), "j1", 0)
    assert (s.loss_last, s.nonfinite_steps, s.nonfinite_first_step) == (None, 1, 11)


def test_a_restart_inside_one_window_shows_as_a_first_step_below_the_last():
    c = make(FakeProcesses(100, 200))
    feed(c, [(0, beat(500, pid=100)), (1, beat(501, pid=100))])
    # The job crashed and restarted from its checkpoint at step 400, in a new process.
    feed(c, [(3, beat(400, pid=200)), (4, beat(401, pid=200))])
    s = summary_of(c.collect(T0 + 5), "j1", 0)
    assert (s.first_step, s.last_step) == (400, 401)
    # The next window begins above the previous window's last step: no restart there.
    feed(c, [(6, beat(402, pid=200))])
    s = summary_of(c.collect(T0 + 10), "j1", 0)
    assert s.first_step == 402


def test_a_restart_between_windows_is_a_first_step_below_the_previous_last_step():
    c = make()
    feed(c, [(0, beat(500)), (1, beat(510))])
    before = summary_of(c.collect(T0 + 5), "j1", 0)
    feed(c, [(6, beat(400)), (7, beat(405))])
    after = summary_of(c.collect(T0 + 10), "j1", 0)
    assert before.last_step == 510 and after.first_step == 400 < before.last_step


def announce(step: int, phase: str, **fields: object) -> bytes:
    return beat(step, step_seconds=0, phase=phase, **fields)


def test_a_checkpoint_is_reported_once_it_ends():
    c = make()
    feed(c, [(0, beat(99)), (1, announce(99, "checkpointing"))])
    s = summary_of(c.collect(T0 + 5), "j1", 0)
    assert s.phase == "checkpointing" and s.checkpoint_step is None  # not completed yet
    feed(c, [(3.5, announce(99, "training")), (4, beat(100))])
    col = c.collect(T0 + 5)
    s = summary_of(col, "j1", 0)
    assert (s.checkpoint_step, s.checkpoint_ts, s.checkpoint_seconds) == (99, T0 + 3.5, 2.5)
    assert value(col.samples, "vigil_training_checkpoint_step", **JR) == 99
    assert value(col.samples, "vigil_training_checkpoint_timestamp_seconds", **JR) == T0 + 3.5
    assert value(col.samples, "vigil_training_checkpoint_duration_seconds", **JR) == 2.5


def test_a_checkpoint_spanning_a_window_boundary():
    c = make()
    feed(c, [(3, beat(200)), (4, announce(200, "checkpointing"))])
    assert summary_of(c.collect(T0 + 5), "j1", 0).checkpoint_step is None
    feed(c, [(9, announce(200, "training"))])
    s = summary_of(c.collect(T0 + 10), "j1", 0)
    assert (s.checkpoint_step, s.checkpoint_ts, s.checkpoint_seconds) == (200, T0 + 9, 5.0)
    # It stays the latest completed checkpoint in later windows, until the next one ends.
    feed(c, [(11, beat(201)), (12, announce(201, "checkpointing")), (13, beat(202))])
    s = summary_of(c.collect(T0 + 15), "j1", 0)
    assert (s.checkpoint_step, s.checkpoint_ts, s.checkpoint_seconds) == (201, T0 + 13, 1.0)


def test_the_next_step_ends_a_checkpoint_whose_return_to_training_was_lost():
    c = make()
    feed(c, [(0, beat(50)), (1, announce(50, "checkpointing")), (2.5, beat(51))])
    s = summary_of(c.collect(T0 + 5), "j1", 0)
    assert (s.checkpoint_step, s.checkpoint_seconds) == (50, 1.5)


def test_repeated_checkpointing_beats_keep_the_first_start():
    c = make()
    feed(c, [(0, announce(50, "checkpointing")), (1, announce(50, "checkpointing")), (3, beat(51))])
    assert summary_of(c.collect(T0 + 5), "j1", 0).checkpoint_seconds == 3.0


def test_a_save_its_process_did_not_live_to_end_is_no_checkpoint():
    c = make(FakeProcesses(100, 200))
    feed(c, [(0, beat(300, pid=100)), (1, announce(300, "checkpointing", pid=100))])
    # The process died mid-save; its restart (a new process) resumes from an older checkpoint.
    feed(c, [(3, beat(250, pid=200))])
    s = summary_of(c.collect(T0 + 5), "j1", 0)
    assert s.checkpoint_step is None and s.first_step == 250
    assert value(c.collect(T0 + 5).samples, "vigil_training_checkpoint_step", **JR) is None


def test_an_evaluation_is_no_checkpoint():
    c = make()
    feed(c, [(0, announce(50, "evaluating")), (2, announce(50, "training")), (3, beat(51))])
    assert summary_of(c.collect(T0 + 5), "j1", 0).checkpoint_step is None


def test_the_report_with_every_new_field_passes_the_wire():
    c = make()
    feed(c, [(0, beat(7, loss=1.5, grad_norm="nan")), (1, announce(7, "checkpointing")), (2, beat(8, loss=-0.5))])
    s = summary_of(c.collect(T0 + 5), "j1", 0)
    report = Report(node="n1", boot_id="b1", ts=T0 + 5, seq=1, interval_seconds=5.0, ranks=[s])
    check(report)
    (back,) = decode_report(encode(report)).ranks
    assert back == s and back.loss_last == -0.5 and back.checkpoint_step == 7


def test_out_of_bound_or_malformed_signals_are_refused_as_schema():
    c = make()
    for bad in ({"loss": 1e19}, {"loss": "NaN"}, {"grad_norm": -1.0}, {"loss": [1.0]}, {"grad_norm": "-nan"}):
        assert c.ingest(beat(1, **bad), T0, IN_PROCESS) == "schema", bad
    assert c.ingest(b'{"job": "j1", "rank": 0, "step": 1, "step_seconds": 1.0, "loss": 1e999}', T0,
                    IN_PROCESS) == "schema"

"""The training collector: heartbeat ingest, log tailing, watchdog, per-rank window summaries."""

from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path

import pytest

from vigil.agent.attribution import IN_PROCESS, UNVERIFIED, Sender
from vigil.agent.collectors import REGISTRY
from vigil.agent.collectors.training import TrainingCollector, TrainingConfig, percentile
from vigil.agent.config import parse_config
from vigil.agent.heartbeat import Heartbeat
from vigil.agent.metric import Sample
from vigil.agent.runner import collect_once
from vigil.agent.snapshot import Snapshot
from vigil.contract.seams import Seams
from vigil.contract.validation import ConfigError
from vigil.contract.wire import RankSummary

FIXTURES = Path(__file__).parent.parent.parent / "fixtures" / "training-logs"
T0 = 1_700_000_000.0


class FakeProcesses:
    """pid_alive seam: the set of live pids."""

    def __init__(self, *alive: int) -> None:
        self.alive = set(alive)

    def __call__(self, pid: int) -> bool:
        return pid in self.alive


def beat(**fields: object) -> bytes:
    body = {"job": "j1", "rank": 0, "step": 1, "step_seconds": 1.0, **fields}
    return json.dumps(body).encode()


def value(samples: list[Sample], name: str, **labels: str) -> float | None:
    for s in samples:
        if s.name == name and all(s.label(k) == v for k, v in labels.items()):
            return s.value
    return None


def summary_of(collection, job: str, rank: int) -> RankSummary:
    (found,) = [r for r in collection.report["ranks"] if r.job == job and r.rank == rank]
    return found


def make(processes: FakeProcesses | None = None, **config: object) -> TrainingCollector:
    return TrainingCollector(TrainingConfig.model_validate(config), pid_alive=processes or FakeProcesses())


# --- ingest -------------------------------------------------------------------------------------

def test_accepted_heartbeat_shows_in_metrics_and_report():
    c = make(FakeProcesses(4321))
    assert c.ingest(beat(step=41, step_seconds=0.9, compute_seconds=0.6, comm_seconds=0.25, gpu=3, pid=4321),
                    T0, IN_PROCESS) is None
    col = c.collect(T0 + 5)  # the end of the window [T0, T0 + 5) the step is summarised in
    lbl = {"job": "j1", "rank": "0"}
    assert value(col.samples, "vigil_training_last_step", **lbl) == 41
    assert value(col.samples, "vigil_training_step_seconds", **lbl) == pytest.approx(0.9)
    assert value(col.samples, "vigil_training_phase_seconds", phase="compute", **lbl) == pytest.approx(0.6)
    assert value(col.samples, "vigil_training_phase_seconds", phase="comm", **lbl) == pytest.approx(0.25)
    # data time was not reported: absent, not zero
    assert value(col.samples, "vigil_training_phase_seconds", phase="data", **lbl) is None
    assert value(col.samples, "vigil_training_last_progress_timestamp_seconds", **lbl) == T0
    assert value(col.samples, "vigil_training_heartbeats_received_total", **lbl) == 1
    assert value(col.samples, "vigil_training_rank_state", state="running", **lbl) == 1
    s = summary_of(col, "j1", 0)
    assert (s.gpu, s.pid, s.last_step, s.steps, s.state) == (3, 4321, 41, 1, "running")
    assert col.events == []


@pytest.mark.parametrize(("payload", "reason"), [
    (b"x" * 5000, "too_large"),
    (b"{not json", "invalid_json"),
    (b"\xff\xfe\x00", "invalid_json"),
    (b'{"job":"j","rank":0,"step":1,"step_seconds":NaN}', "invalid_json"),
    (b"", "invalid_json"),
    (b"[1, 2]", "not_object"),
    (b'"a string"', "not_object"),
    (beat(stepz=3), "unknown_field"),
    (json.dumps({"job": "j", "rank": 0, "step_seconds": 1.0}).encode(), "schema"),  # no step
    (beat(rank=-1), "schema"),
    (beat(step="ten"), "schema"),
    (beat(step_seconds=-0.5), "schema"),
    (beat(job=""), "schema"),
    (beat(pid=0), "schema"),
    (b'{"job":"j","rank":0,"step":1,"step_seconds":1e999}', "schema"),  # json reads it as infinity
    (b'{"job":"j","rank":0,"step":1,"step_seconds":1,"comm_seconds":1e999}', "schema"),
])
def test_malformed_heartbeats_are_counted_by_reason_and_change_nothing(payload, reason):
    c = make()
    assert c.ingest(beat(step=5), T0, IN_PROCESS) is None
    assert c.ingest(payload, T0 + 1, IN_PROCESS) == reason
    col = c.collect(T0 + 2)
    assert value(col.samples, "vigil_training_heartbeats_rejected_total", reason=reason) == 1
    assert sum(s.value for s in col.samples if s.name == "vigil_training_heartbeats_rejected_total") == 1
    assert [r.last_step for r in col.report["ranks"]] == [5]  # what was accepted is kept


def test_limits_on_jobs_and_ranks():
    c = make(max_jobs=2, max_ranks=3)
    assert c.ingest(beat(job="a", rank=0), T0, IN_PROCESS) is None
    assert c.ingest(beat(job="b", rank=0), T0, IN_PROCESS) is None
    assert c.ingest(beat(job="c", rank=0), T0, IN_PROCESS) == "too_many_jobs"
    assert c.ingest(beat(job="a", rank=1), T0, IN_PROCESS) is None
    assert c.ingest(beat(job="a", rank=2), T0, IN_PROCESS) == "too_many_ranks"
    assert c.ingest(beat(job="a", rank=1, step=2), T0, IN_PROCESS) is None  # known ranks keep reporting
    col = c.collect(T0)
    assert value(col.samples, "vigil_training_heartbeats_rejected_total", reason="too_many_jobs") == 1
    assert value(col.samples, "vigil_training_heartbeats_rejected_total", reason="too_many_ranks") == 1
    assert value(col.samples, "vigil_training_ranks") == 3


# --- summaries ----------------------------------------------------------------------------------

def test_percentile_interpolates_between_ranks():
    values = [float(v) for v in range(1, 11)]
    assert percentile(values, 0.5) == pytest.approx(5.5)
    assert percentile(values, 0.9) == pytest.approx(9.1)
    assert percentile([2.0], 0.9) == 2.0
    with pytest.raises(ValueError):
        percentile([], 0.5)


def test_window_summary_has_quantiles_of_the_window_only():
    c = make(window_seconds=60)
    # an old slow step, outside the window by the time of collection
    c.ingest(beat(step=100, step_seconds=50.0, compute_seconds=40.0), T0, IN_PROCESS)
    for i in range(1, 11):
        c.ingest(beat(step=100 + i, step_seconds=float(i), compute_seconds=i / 2, comm_seconds=0.1 * i,
                      data_seconds=0.01), T0 + 100 + i, IN_PROCESS)
    # windows of 60 s are aligned on the clock: T0 + 100 starts one (T0 is 20 s past a minute)
    col = c.collect(T0 + 160)
    s = summary_of(col, "j1", 0)
    assert s.window_seconds == 60
    assert s.window_end_ts == T0 + 160
    assert s.steps == 10  # 101..110, counted from the step reached before the window
    assert s.last_step == 110
    assert s.step_seconds_p50 == pytest.approx(5.5)
    assert s.step_seconds_p90 == pytest.approx(9.1)
    assert s.compute_seconds_p50 == pytest.approx(2.75)
    assert s.comm_seconds_p90 == pytest.approx(0.91)
    assert s.data_seconds_p50 == pytest.approx(0.01)
    assert value(col.samples, "vigil_training_window_step_seconds", job="j1", rank="0", percentile="90") \
        == pytest.approx(9.1)


def test_steps_in_window_count_step_jumps_and_repeats():
    c = make(window_seconds=30)
    c.ingest(beat(step=10), T0, IN_PROCESS)
    c.ingest(beat(step=20), T0 + 1, IN_PROCESS)  # a logged interval of 10 iterations
    c.ingest(beat(step=20), T0 + 2, IN_PROCESS)  # a repeat is not progress
    c.ingest(beat(step=21), T0 + 3, IN_PROCESS)
    s = summary_of(c.collect(T0 + 10), "j1", 0)  # the window [T0 - 20, T0 + 10) is complete
    assert s.steps == 12  # first step seen, then +10, +0, +1
    assert s.last_progress_ts == T0 + 3
    s = summary_of(c.collect(T0 + 100), "j1", 0)
    assert (s.steps, s.step_seconds_p50, s.last_step) == (0, None, 21)


def test_ring_buffer_is_bounded():
    c = make(max_steps_per_rank=16, window_seconds=100)
    for i in range(100):
        c.ingest(beat(step=i, step_seconds=1.0 if i < 84 else 3.0), T0 + i, IN_PROCESS)
    s = summary_of(c.collect(T0 + 100), "j1", 0)
    assert s.steps == 16
    assert s.step_seconds_p50 == 3.0  # only the last 16 steps are remembered


# --- watchdog -----------------------------------------------------------------------------------

def test_hang_is_one_urgent_event_per_episode():
    procs = FakeProcesses(77)
    c = make(procs, hang_seconds=300, window_seconds=60)
    c.ingest(beat(step=5, pid=77, gpu=2), T0, IN_PROCESS)
    assert c.collect(T0 + 299).events == []
    col = c.collect(T0 + 300)
    (event,) = col.events
    assert (event.kind, event.urgent, event.source, event.job, event.rank, event.gpu) == \
        ("hang", True, "heartbeat", "j1", 0, 2)
    assert summary_of(col, "j1", 0).state == "hung"
    assert value(col.samples, "vigil_training_rank_state", job="j1", rank="0", state="hung") == 1
    assert c.collect(T0 + 400).events == []  # still hung: not repeated
    c.ingest(beat(step=5, pid=77), T0 + 450, IN_PROCESS)  # alive but the same step: still no progress
    assert c.collect(T0 + 460).events == []
    c.ingest(beat(step=6, pid=77), T0 + 500, IN_PROCESS)
    col = c.collect(T0 + 501)
    assert col.events == [] and summary_of(col, "j1", 0).state == "running"
    assert [e.kind for e in c.collect(T0 + 800).events] == ["hang"]  # a new episode


def test_a_rank_that_advances_rarely_is_hung_only_after_missing_its_own_beats():
    c = make(hang_seconds=300)
    c.ingest(beat(step=100), T0, IN_PROCESS)
    c.ingest(beat(step=200), T0 + 400, IN_PROCESS)  # e.g. Megatron logging every 100 iterations of 4 s
    assert c.collect(T0 + 400 + 301).events == []
    assert c.collect(T0 + 400 + 1199).events == []
    assert [e.kind for e in c.collect(T0 + 400 + 1200).events] == ["hang"]


def test_exit_when_the_process_is_gone():
    procs = FakeProcesses(77)
    c = make(procs, hang_seconds=300)
    c.ingest(beat(step=5, pid=77, rank=3, gpu=3), T0, IN_PROCESS)
    assert c.collect(T0 + 1).events == []
    procs.alive.clear()
    col = c.collect(T0 + 2)
    (event,) = col.events
    assert (event.kind, event.urgent, event.rank, event.gpu) == ("rank_exit", True, 3, 3)
    assert summary_of(col, "j1", 3).state == "exited"
    assert c.collect(T0 + 600).events == []  # an exited rank is not also hung, nor re-reported
    # torchelastic restarts the rank in a new process: a new episode
    procs.alive.add(78)
    c.ingest(beat(step=6, pid=78, rank=3), T0 + 700, IN_PROCESS)
    assert summary_of(c.collect(T0 + 701), "j1", 3).state == "running"
    procs.alive.clear()
    assert [e.kind for e in c.collect(T0 + 702).events] == ["rank_exit"]


def test_idle_ranks_are_evicted_but_a_live_hung_rank_stays():
    procs = FakeProcesses(10)
    c = make(procs, hang_seconds=100, evict_after_seconds=900)
    c.ingest(beat(job="done", step=9, pid=11), T0, IN_PROCESS)  # its process is gone
    c.ingest(beat(job="nopid", step=9), T0, IN_PROCESS)
    c.ingest(beat(job="stuck", step=9, pid=10), T0, IN_PROCESS)
    col = c.collect(T0 + 950)
    assert {r.job for r in col.report["ranks"]} == {"stuck"}
    assert value(col.samples, "vigil_training_ranks_evicted_total") == 2
    assert value(col.samples, "vigil_training_last_step", job="done", rank="0") is None


# --- logs ---------------------------------------------------------------------------------------

def log_collector(tmp_path: Path, fmt: str, **extra: object) -> tuple[TrainingCollector, Path]:
    path = tmp_path / "train.log"
    path.write_text("startup banner\n")  # present at start: followed from its end
    c = make(log_files=[{"path": str(path), "format": fmt, "job": "run1", "rank": 7, **extra}])
    return c, path


def append(path: Path, text: str) -> None:
    with path.open("a") as f:
        f.write(text)


def test_megatron_log(tmp_path):
    c, path = log_collector(tmp_path, "megatron", gpu=7)
    append(path, (FIXTURES / "megatron.log").read_text())
    c.collect(T0)  # reads the lines, stamped T0: summarised once their window is complete
    col = c.collect(T0 + 5)
    s = summary_of(col, "run1", 7)
    assert (s.last_step, s.steps, s.gpu) == (40, 31, 7)  # 10 seen first, then 10 more per log line
    assert s.step_seconds_p50 == pytest.approx(1.24515)  # median of 1.2503, 1.2345, 1.301, 1.240
    assert value(col.samples, "vigil_training_step_seconds", job="run1", rank="7") == pytest.approx(1.24)
    assert value(col.samples, "vigil_training_log_steps_total", path=str(path)) == 4
    # log-derived progress is not a heartbeat
    assert value(col.samples, "vigil_training_heartbeats_received_total", job="run1", rank="7") is None


def test_deepspeed_log(tmp_path):
    c, path = log_collector(tmp_path, "deepspeed")
    append(path, (FIXTURES / "deepspeed.log").read_text())
    c.collect(T0)
    col = c.collect(T0 + 5)
    s = summary_of(col, "run1", 7)
    assert s.last_step == 30
    # 25.2 s between the step=10 and step=20 lines: 2.52 s a step; the first has no predecessor
    assert s.step_seconds_p50 == pytest.approx(2.52)
    assert value(col.samples, "vigil_training_log_steps_total", path=str(path)) == 3


def test_regex_log_and_bad_numbers_are_counted(tmp_path):
    c, path = log_collector(tmp_path, "regex",
                            regex=r"step (?P<step>\d+) took (?P<step_ms>\S+) ms \(data (?P<data_seconds>\S+)s\)")
    append(path, "step 1 took 500 ms (data 0.05s)\nstep 2 took fast ms (data 0.01s)\nstep 3 took 520.5 ms "
                 "(data 0.07s)\nunrelated line\n")
    c.collect(T0)
    col = c.collect(T0 + 5)
    s = summary_of(col, "run1", 7)
    assert (s.last_step, s.step_seconds_p90) == (3, pytest.approx(0.51845))
    assert value(col.samples, "vigil_training_phase_seconds", job="run1", rank="7", phase="data") == 0.07
    assert value(col.samples, "vigil_training_log_errors_total", path=str(path), reason="parse") == 1


def test_deepspeed_older_progress_line(tmp_path):
    c, path = log_collector(tmp_path, "deepspeed")
    append(path, "[2024-05-02 10:20:00,000] [INFO] [engine.py:1200:_report_progress] rank:0 step=50, skipped=0, "
                 "lr=[0.0001], mom=[(0.9, 0.999)]\n"
                 "[2024-05-02 10:20:10,000] [INFO] [engine.py:1200:_report_progress] rank:0 step=60, skipped=0, "
                 "lr=[0.0001], mom=[(0.9, 0.999)]\n")
    c.collect(T0)
    s = summary_of(c.collect(T0 + 5), "run1", 7)
    assert (s.last_step, s.step_seconds_p50) == (60, pytest.approx(1.0))


def test_partial_lines_wait_for_their_newline(tmp_path):
    c, path = log_collector(tmp_path, "regex", regex=r"step (?P<step>\d+) (?P<step_seconds>[\d.]+)")
    append(path, "step 5 1.5")
    assert c.collect(T0).report["ranks"] == []
    append(path, "0\n")
    c.collect(T0 + 1)
    assert summary_of(c.collect(T0 + 5), "run1", 7).step_seconds_p50 == pytest.approx(1.5)


def test_rotation_and_truncation_are_followed(tmp_path):
    c, path = log_collector(tmp_path, "regex", regex=r"step (?P<step>\d+) (?P<step_seconds>[\d.]+)")
    append(path, "step 1 1.0\n")
    assert summary_of(c.collect(T0), "run1", 7).last_step == 1
    append(path, "step 2 1.0\n")  # written just before the rotation: must not be lost
    os.rename(path, tmp_path / "train.log.1")
    path.write_text("step 3 1.0\nstep 4 1.0\n")
    c.collect(T0 + 1)
    col = c.collect(T0 + 5)  # the window [T0, T0 + 5) holds steps 1-4
    assert summary_of(col, "run1", 7).steps == 4
    assert value(col.samples, "vigil_training_log_rotations_total", path=str(path)) == 1
    path.write_text("step 5 2.0\n")  # truncated in place (copytruncate) and rewritten
    col = c.collect(T0 + 6)
    assert summary_of(col, "run1", 7).last_step == 5
    assert value(col.samples, "vigil_training_log_rotations_total", path=str(path)) == 2


def test_log_appearing_later_is_read_from_start_and_unreadable_is_counted(tmp_path):
    path = tmp_path / "later.log"
    c = make(log_files=[{"path": str(path), "format": "megatron"}])
    col = c.collect(T0)
    assert col.report["ranks"] == []  # not there yet: nothing, and no error
    assert value(col.samples, "vigil_training_log_errors_total", path=str(path), reason="unreadable") == 0
    shutil.copy(FIXTURES / "megatron.log", path)
    assert summary_of(c.collect(T0 + 1), "later", 0).last_step == 40  # job named after the file
    os.remove(path)
    path.mkdir()  # something unreadable as a file at the path
    col = c.collect(T0 + 2)
    assert value(col.samples, "vigil_training_log_errors_total", path=str(path), reason="unreadable") == 1
    c.close()


# --- config and wiring --------------------------------------------------------------------------

def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"collectors\.training\.log_files\.0.*regex"):
        parse_config({"collectors": {"training": {"log_files": [{"path": "/x", "format": "regex"}]}}})
    with pytest.raises(ConfigError, match=r"collectors\.training\.udp_listen"):
        parse_config({"collectors": {"training": {"udp_listen": "9401"}}})
    with pytest.raises(ConfigError, match=r"collectors\.training\.hang_secs: unknown key"):
        parse_config({"collectors": {"training": {"hang_secs": 5}}})
    cfg = parse_config({"collectors": {"training": {"udp_listen": "[::1]:9999"}}})
    assert cfg.collectors.training.udp_address == ("::1", 9999)


def test_registry_builds_the_collector_with_the_pid_seam():
    cfg = parse_config({"collectors": {"training": {"hang_seconds": 10}}})
    c = REGISTRY["training"](cfg, Seams(extra={"pid_alive": FakeProcesses()}))
    assert c.name == "training"
    assert isinstance(c, TrainingCollector)
    c.ingest(beat(pid=5), T0, IN_PROCESS)
    assert [e.kind for e in c.collect(T0 + 1).events] == ["rank_exit"]
    names = {s.name for s in c.specs}
    assert {s.name for s in c.collect(T0 + 2).samples} <= names


def test_end_to_end_udp_from_the_client():
    c = make(FakeProcesses(os.getpid()))
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(2.0)
    try:
        with Heartbeat(job="e2e", rank=1, gpu=0, addr=sock.getsockname(), env={}) as hb:
            for step in range(1, 6):
                hb.step(step, 0.5 + step / 10, compute_seconds=0.4, comm_seconds=0.1)
            for _ in range(5):
                assert c.ingest(sock.recv(65536), T0, IN_PROCESS) is None
    finally:
        sock.close()
    col = c.collect(T0 + 5)
    s = summary_of(col, "e2e", 1)
    assert (s.steps, s.last_step, s.pid, s.gpu, s.state) == (5, 5, os.getpid(), 0, "running")
    assert s.step_seconds_p50 == pytest.approx(0.8)
    assert s.compute_seconds_p50 == pytest.approx(0.4)


# --- job identity (issue 37) --------------------------------------------------------------------

def slurm(job: str, pid: int, uid: int = 1000) -> Sender:
    return Sender("scheduler", job=job, pid=pid, uid=uid)


def jobs_of(c: TrainingCollector, now: float = T0) -> dict[tuple[str, int], int | None]:
    return {(r.job, r.rank): r.pid for r in c.collect(now).report["ranks"]}


def rejected(c: TrainingCollector, reason: str, now: float = T0) -> float | None:
    return value(c.collect(now).samples, "vigil_training_heartbeats_rejected_total", reason=reason)


def test_a_heartbeat_is_keyed_by_its_senders_job_and_its_free_name_is_a_label():
    c = make(FakeProcesses(100))
    # A torchrun run id, or any free name: the job is the sender's Slurm job; the name a label.
    assert c.ingest(beat(job="pretrain-run-7", pid=7), T0, slurm("4242", 100)) is None
    assert jobs_of(c) == {("4242", 0): 100}  # the kernel's pid, not the claimed one
    info = [s for s in c.collect(T0).samples if s.name == "vigil_training_job_info"]
    assert [dict(s.labels) for s in info] == [{"job": "4242", "trust": "scheduler", "name": "pretrain-run-7"}]
    # Claiming its own job id is the same job.
    assert c.ingest(beat(job="4242", step=2), T0, slurm("4242", 100)) is None
    assert jobs_of(c) == {("4242", 0): 100}


@pytest.mark.parametrize("claim", ["4243", "pod/042efd86-1f3b-4f2f-8736-f31c58e95bbc", "uid/0/x", "unverified/x"])
def test_a_claim_naming_another_job_is_refused_and_counted(claim: str):
    c = make(FakeProcesses(100))
    assert c.ingest(beat(job=claim), T0, slurm("4242", 100)) == "job_mismatch"
    assert jobs_of(c) == {} and rejected(c, "job_mismatch") == 1


def test_unverified_and_uid_keyed_senders_live_in_their_own_namespace():
    c = make()
    assert c.ingest(beat(job="demo"), T0, UNVERIFIED) is None
    assert c.ingest(beat(job="demo"), T0, Sender("uid", pid=5, uid=1000)) is None
    assert set(jobs_of(c)) == {("unverified/demo", 0), ("uid/1000/demo", 0)}
    # Neither can name a scheduler's job, nor put a list, a pattern or a namespace in its key.
    for claim, reason in (("4242", "job_mismatch"), ("teamA,teamB", "bad_job_name"), ("a*", "bad_job_name"),
                          ("x/y", "bad_job_name"), ("a b", "bad_job_name")):
        assert c.ingest(beat(job=claim), T0, UNVERIFIED) == reason, claim


def test_a_rank_belongs_to_its_first_verified_process_while_it_lives():
    alive = FakeProcesses(100, 200)
    c = make(alive)
    assert c.ingest(beat(rank=3, step=1), T0, slurm("4242", 100)) is None
    # Another process of the same job (a rank started twice, or a user's second process).
    assert c.ingest(beat(rank=3, step=99), T0 + 1, slurm("4242", 200)) == "rank_taken"
    assert c.collect(T0 + 1).report["ranks"][0].last_step == 1 and rejected(c, "rank_taken", T0 + 1) == 1
    # The owner exits; its restart (a new process) takes the rank over.
    alive.alive.discard(100)
    assert c.ingest(beat(rank=3, step=2), T0 + 2, slurm("4242", 200)) is None
    assert jobs_of(c, T0 + 2) == {("4242", 3): 200}


@pytest.mark.parametrize("job", ["bad\ud800surrogate", "line\nforged: Xid 79", "\x1b[31mred", "tab\there", "nul\x00"])
def test_a_control_character_or_unpaired_surrogate_is_refused_and_the_cycle_stays_green(job: str):
    from vigil.agent.exporter import SnapshotExporter, render

    c = make(FakeProcesses(100))
    payload = json.dumps({"job": job, "rank": 0, "step": 1, "step_seconds": 1.0}).encode()  # \ud800 escaped
    for sender in (slurm("4242", 100), UNVERIFIED, IN_PROCESS):
        assert c.ingest(payload, T0, sender) == "bad_text"
    assert c.ingest(beat(job="fine"), T0, slurm("4242", 100)) is None
    result = collect_once(c, T0 + 5)  # the cycle the bad heartbeat used to fail, every time
    assert result.success, result
    snapshot = Snapshot()
    snapshot.put("training", result)
    body = render(SnapshotExporter(list(c.specs), [snapshot.samples]))
    assert b'vigil_training_last_step{job="4242",rank="0"} 1' in body
    assert rejected(c, "bad_text", T0 + 5) == 3


def test_invented_jobs_cannot_squat_the_real_jobs_slots():
    """16 invented names (the site opted in to UDP) fill only the unverified cap; the node's real
    Slurm jobs still get every verified slot, and take rank slots from unverified ones."""
    c = make(max_jobs=2, max_unverified_jobs=4, max_ranks=6)
    outcomes = [c.ingest(beat(job=f"fake-{i}"), T0, UNVERIFIED) for i in range(16)]
    assert outcomes.count(None) == 4 and outcomes.count("too_many_unverified_jobs") == 12
    assert c.ingest(beat(job="fake-0", rank=1), T0, UNVERIFIED) is None  # 5 ranks, all unverified
    assert c.ingest(beat(rank=0), T0, slurm("4242", 100)) is None  # the 6th slot
    assert c.ingest(beat(rank=1), T0, slurm("4242", 101)) is None  # evicts the oldest unverified rank
    assert c.ingest(beat(rank=0), T0, slurm("4243", 102)) is None
    assert c.ingest(beat(rank=0), T0, slurm("4244", 103)) == "too_many_jobs"  # the verified cap is the real one
    ranks = jobs_of(c)
    assert {j for j, _ in ranks if not j.startswith("unverified/")} == {"4242", "4243"} and len(ranks) == 6


def test_one_job_cannot_fill_the_nodes_rank_table():
    c = make(max_ranks_per_job=2)
    assert c.ingest(beat(rank=0), T0, slurm("4242", 100)) is None
    assert c.ingest(beat(rank=1), T0, slurm("4242", 101)) is None
    assert c.ingest(beat(rank=2), T0, slurm("4242", 102)) == "too_many_ranks_per_job"
    assert c.ingest(beat(rank=0), T0, slurm("4243", 103)) is None

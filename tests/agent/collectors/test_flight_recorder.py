"""The Flight Recorder collector reads real torch 2.13 gloo dumps (tests/fixtures/flight_recorder),
binds them to the job of the process owner, and refuses and counts what it cannot trust."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from vigil.agent.collectors.collector import Collection
from vigil.agent.collectors.flight_recorder import (
    DUMPS,
    FlightRecorderCollector,
    FlightRecorderConfig,
    JobsByUid,
    jobs_by_uid,
    parse_dump,
)
from vigil.agent.config import parse_config
from vigil.agent.report_delta import delta, whole
from vigil.agent.reporter import build_report
from vigil.agent.snapshot import CollectorResult, Snapshot
from vigil.contract.validation import ConfigError
from vigil.contract.wire import CollectiveState

FIXTURES = Path(__file__).parent.parent.parent / "fixtures" / "flight_recorder"
NOW = 1_800_000_000.0
UID = os.getuid()
DIR = "var/tmp/vigil-fr/run1"


def _config(**kw: object) -> FlightRecorderConfig:
    return FlightRecorderConfig(enabled=True, **kw)


def _put(root: Path, name: str, data: bytes, mtime: float = NOW - 10) -> Path:
    path = root / DIR / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    os.utime(path, (mtime, mtime))
    return path


def _fixture(name: str) -> bytes:
    return (FIXTURES / name).read_bytes()


def _collector(root: Path, jobs: JobsByUid | None = None, **kw: object) -> FlightRecorderCollector:
    table = {UID: {"4242": set()}} if jobs is None else jobs
    return FlightRecorderCollector(_config(**kw), root=root, jobs_of_uid=lambda: table)


def _counts(c: Collection) -> dict[str, float]:
    return {s.labels[0][1]: s.value for s in c.samples if s.name == DUMPS.name}


def _states(c: Collection) -> dict[tuple[int, str], CollectiveState]:
    return {(s.rank, s.group): s for s in c.report["collectives"]}


def test_real_gloo_hang_dumps_give_each_ranks_progress(tmp_path: Path) -> None:
    for r in range(3):
        _put(tmp_path, f"nccl_trace_rank_{r}", _fixture(f"fr_hang_rank{r}.json"))
    out = _collector(tmp_path).collect(NOW)
    states = _states(out)
    # Ranks 0 and 1 are inside allreduce 6 of the default group; rank 2 stopped after seq 5.
    for r in (0, 1):
        s = states[(r, "0")]
        assert (s.last_entered_seq, s.last_completed_seq, s.op, s.stage) == (6, 5, "all_reduce", "scheduled")
        assert s.size_bytes == 4096 and s.job == "4242" and s.dump_ts == NOW - 10
        assert states[(r, "1")].last_entered_seq == states[(r, "1")].last_completed_seq == 3
        assert states[(r, "1")].stage == "completed"
    s2 = states[(2, "0")]
    assert (s2.last_entered_seq, s2.last_completed_seq, s2.stage) == (5, 5, "completed")
    assert (2, "1") not in states  # rank 2 is not in the pair group
    assert _counts(out)["read"] == 3


def test_unchanged_dumps_are_read_once_and_stale_ones_leave_the_report(tmp_path: Path) -> None:
    _put(tmp_path, "nccl_trace_rank_0", _fixture("fr_healthy_rank0.json"))
    c = _collector(tmp_path, fresh_seconds=60)
    assert len(c.collect(NOW).report["collectives"]) == 2
    again = c.collect(NOW + 20)
    assert len(again.report["collectives"]) == 2 and _counts(again)["read"] == 1
    assert c.collect(NOW + 60).report["collectives"] == []  # 70 s old: past fresh_seconds


@pytest.mark.parametrize(("data", "outcome"), [
    (b"\x80\x04\x95pickle", "malformed"),  # torch's pickle format: never unpickled
    (b'{"version": "2.10", "entries": [{"collective_seq_id": NaN}]}', "malformed"),
    (b'{"version": "2.10", "entries": [{"collective_seq_id": 1, "pg_id": 0}]}', "malformed"),
    (b'{"entries": []}', "malformed"),
    (b"[" * 100_000 + b"]" * 100_000, "malformed"),
    (b'{"version": "2.10", "entries": "x"}', "malformed"),
])
def test_hostile_dumps_are_counted_and_skipped(tmp_path: Path, data: bytes, outcome: str) -> None:
    _put(tmp_path, "nccl_trace_rank_0", data)
    _put(tmp_path, "nccl_trace_rank_1", _fixture("fr_hang_rank1.json"))
    out = _collector(tmp_path, max_file_bytes=1 << 20).collect(NOW)
    assert _counts(out)[outcome] == 1 and _counts(out)["read"] == 1
    assert {s.rank for s in out.report["collectives"]} == {1}


def test_oversize_links_and_bad_names_are_refused(tmp_path: Path) -> None:
    _put(tmp_path, "nccl_trace_rank_0", b" " * 4096 + _fixture("fr_hang_rank0.json"))
    _put(tmp_path, "nccl_trace_rank_x", _fixture("fr_hang_rank1.json"))  # no rank in its name
    secret = tmp_path / "etc-shadow"
    secret.write_text("root:x:0:")
    (tmp_path / DIR / "nccl_trace_rank_2").symlink_to(secret)
    out = _collector(tmp_path, max_file_bytes=4096).collect(NOW)
    assert out.report["collectives"] == []
    counts = _counts(out)
    assert counts["too_large"] == 1 and counts["bad_rank"] == 1 and counts["read"] == 0


def test_rank_beyond_the_default_groups_size_is_refused(tmp_path: Path) -> None:
    # rank 2's real dump states the default group's ranks [0, 1, 2] in its pg_config... under the
    # empty name (gloo), so a size is stated only when the group's own name is used (NCCL's way).
    doc = json.loads(_fixture("fr_hang_rank2.json"))
    doc["pg_config"] = {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2]"}}
    _put(tmp_path, "nccl_trace_rank_7", json.dumps(doc).encode())
    out = _collector(tmp_path).collect(NOW)
    assert out.report["collectives"] == [] and _counts(out)["bad_rank"] == 1
    assert parse_dump(json.dumps(doc).encode(), 2)[0].group_size == 3


def test_dump_binds_only_to_the_one_live_job_of_its_owner(tmp_path: Path) -> None:
    _put(tmp_path, "nccl_trace_rank_0", _fixture("fr_hang_rank0.json"))
    # The dump names no job; even one that claimed a job would be ignored: the owner decides.
    finished = _collector(tmp_path, jobs={}).collect(NOW)
    assert finished.report["collectives"] == [] and _counts(finished)["no_job"] == 1
    two = _collector(tmp_path, jobs={UID: {"1": set(), "2": set()}}).collect(NOW)
    assert two.report["collectives"] == [] and _counts(two)["ambiguous_job"] == 1
    other_user = _collector(tmp_path, jobs={UID + 1: {"1": set()}}).collect(NOW)
    assert other_user.report["collectives"] == []
    # The job's processes here are ranks 4-7: a dump for rank 0 speaks for a rank elsewhere.
    elsewhere = _collector(tmp_path, jobs={UID: {"1": {4, 5, 6, 7}}}).collect(NOW)
    assert elsewhere.report["collectives"] == [] and _counts(elsewhere)["rank_not_here"] == 1
    here = _collector(tmp_path, jobs={UID: {"1": {0, 1}}}).collect(NOW)
    assert {s.job for s in here.report["collectives"]} == {"1"} and _counts(here)["read"] == 1


def test_jobs_by_uid_reads_the_process_table(tmp_path: Path) -> None:
    for pid, uid, env in ((10, 1000, b"RANK=3\0SLURM_PROCID=9\0"), (11, 1000, b"SLURM_PROCID=2\0"),
                          (12, 0, b"RANK=0\0"), (13, 1000, b"RANK=x\0")):
        d = tmp_path / str(pid)
        d.mkdir()
        (d / "status").write_bytes(f"Name:\tpython\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n".encode())
        (d / "environ").write_bytes(env)
    (tmp_path / "self").mkdir()
    jobs = {10: "77", 11: "77", 12: None, 13: "78"}
    assert jobs_by_uid(tmp_path, jobs.get) == {1000: {"77": {3, 2}, "78": set()}}


def test_config_is_off_by_default_and_rejects_relative_globs() -> None:
    assert parse_config({}).collectors.flight_recorder.enabled is False
    with pytest.raises(ConfigError, match="absolute"):
        parse_config({"collectors": {"flight_recorder": {"dump_glob": "fr/*"}}})


def test_collectives_go_whole_into_full_and_compact_reports(tmp_path: Path) -> None:
    _put(tmp_path, "nccl_trace_rank_0", _fixture("fr_hang_rank0.json"))
    c = _collector(tmp_path)
    snap = Snapshot()
    base = None
    for seq, now in ((1, NOW), (2, NOW + 5)):
        snap.put("flight_recorder", CollectorResult(c.collect(now), True, 0.01, now))
        report = build_report(snap, [], node="n1", boot_id="b", seq=seq, ts=now, interval_seconds=2.5,
                              topology={})
        assert [(s.rank, s.group, s.last_entered_seq) for s in report.collectives] == [(0, "0", 6), (0, "1", 3)]
        state = whole(report)
        if base is not None:
            body = delta(base, state)
            assert body is not None and body["collectives"] == state["collectives"]
        base = state

"""Application signals in training logs, against real NCCL, PyTorch and CUDA lines: what each
pattern finds (kind, rank, peer), the lines that must not produce an event, and the counting and
rate limit that keep a log repeating one line from flooding reports."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.agent.collectors.test_training import T0, append, make, value
from vigil.agent.app_log import FORWARD_INTERVAL_SECONDS, KINDS, PATTERNS, AppLogSignals, match_line

FIXTURES = Path(__file__).parent.parent / "fixtures" / "app-signals"


def signals_of(name: str) -> list[tuple[int, str, int | None, str | None]]:
    found = []
    for number, line in enumerate((FIXTURES / name).read_text().splitlines(), 1):
        s = match_line(line)
        if s is not None:
            found.append((number, s.kind, s.rank, s.peer))
    return found


def test_torch_watchdog_timeouts_name_their_rank():
    assert signals_of("torch-nccl-timeout.log") == [
        (1, "nccl_timeout", 0, None), (2, "nccl_timeout", 4, None),  # torch 2.x, "[rankN]:" prefix
        (4, "nccl_timeout", 1, None),
        (6, "nccl_timeout", 1, None), (7, "nccl_timeout", 3, None),  # torch 1.x, no Numel fields
        (8, "nccl_timeout", 0, None),  # behind a tqdm bar on the same line
        (9, "nccl_timeout", 0, None)]
    # The watchdog's follow-on "[PG 1 Rank 0] Exception (either an error or timeout)" lines (3, 5)
    # repeat the same fault: no second event.


def test_cuda_errors():
    assert signals_of("cuda-errors.log") == [
        (1, "cuda_error", None, None),
        (6, "cuda_error", 1, None),  # the NCCL watchdog re-raising it names its rank
        (12, "cuda_error", None, None),
        (16, "cuda_error", None, None)]  # the THC spelling of torch < 1.0
    line = (FIXTURES / "cuda-errors.log").read_text().splitlines()[0]
    assert match_line(line).message == "RuntimeError: CUDA error: uncorrectable ECC error encountered"


def test_nccl_warnings_name_the_peer_and_info_lines_do_not_count():
    assert signals_of("nccl-warn.log") == [
        (1, "nccl_warn", None, "10.216.210.236"), (6, "nccl_warn", None, "10.216.210.236"),
        (11, "nccl_warn", None, "10.216.210.236"),
        (12, "nccl_warn", None, "fe80::966d:ae03:8b:df78%ib0"),  # IPv6 link-local, as written
        (15, "nccl_warn", None, "10.10.1.3"),  # "Connection closed by remote peer"
        (19, "nccl_warn", None, None), (21, "nccl_warn", None, None)]  # WARN lines naming no peer
    # NCCL's "[4]" is the CUDA device, not a rank; "from rank 2" in free text is not a rank tag either.


def test_lookalikes_produce_nothing():
    lines = (FIXTURES / "lookalikes.log").read_text().splitlines()
    assert len(lines) == 8
    assert [line for line in lines if match_line(line) is not None] == []


@pytest.mark.parametrize("line", [
    "RuntimeError: CUDA error:",  # no error text
    "NCCL WARN NET/IB : Got completion from peer 10.0.0.1<1>",  # no NCCL device tag: someone's text
    "[rank0]: Watchdog caught collective operation timeout: (see the runbook)",
])
def test_fragments_of_the_formats_are_not_signals(line):
    assert match_line(line) is None


def test_a_huge_rank_number_is_not_carried():
    line = ("[rank9999999]:[E321 02:07:08.408271257 ProcessGroupNCCL.cpp:607] Watchdog caught collective operation "
            "timeout: WorkNCCL(SeqNum=1, OpType=ALLREDUCE, Timeout(ms)=600000) ran for 600060 milliseconds before "
            "timing out.")
    assert match_line(line).rank is None


def test_every_pattern_has_a_kind_the_collector_counts():
    # nccl_ras comes from the RAS report reader (agent/nccl_ras.py), not a one-line pattern.
    assert {p.kind for p in PATTERNS} | {"nccl_ras"} == set(KINDS)


def test_a_spewing_line_is_counted_and_forwarded_collapsed_at_most_once_per_interval():
    signals = AppLogSignals("4242")
    warn = (FIXTURES / "nccl-warn.log").read_text().splitlines()
    for i in range(1000):
        signals.feed(warn[0], T0 + i * 0.001)  # one NCCL WARN, a thousand times in a second
    (ev,) = signals.drain(T0 + 1)
    assert (ev.kind, ev.job, ev.peer, ev.rank, ev.count, ev.urgent, ev.source) == (
        "nccl_warn", "4242", "10.216.210.236", None, 1000, False, "training_log")
    assert (ev.ts, ev.last_ts) == (T0, T0 + 0.999)
    # The same line's variants (other opcode, other port) fold into the same key; within the
    # interval they wait, then go out as one event with their count.
    signals.feed(warn[5], T0 + 2)
    signals.feed(warn[10], T0 + 3)
    assert signals.drain(T0 + 1 + FORWARD_INTERVAL_SECONDS / 2) == []
    (ev,) = signals.drain(T0 + 1 + FORWARD_INTERVAL_SECONDS)
    assert (ev.count, ev.ts, ev.last_ts) == (2, T0 + 2, T0 + 3)
    assert signals.matched == {"nccl_timeout": 0, "cuda_error": 0, "nccl_warn": 1002, "nccl_ras": 0}


def test_distinct_ranks_and_peers_are_distinct_events_and_timeouts_are_urgent():
    signals = AppLogSignals("4242")
    for line in (FIXTURES / "torch-nccl-timeout.log").read_text().splitlines():
        signals.feed(line, T0)
    events = signals.drain(T0)
    by_rank = {(e.rank, e.count) for e in events}
    # ranks 0 (torch 2 and torch 1 spellings, three lines), 4, 1 (two spellings) and 3
    assert {rank for rank, _ in by_rank} == {0, 1, 3, 4}
    assert sum(e.count for e in events) == 7 and all(e.urgent and e.kind == "nccl_timeout" for e in events)


def test_an_ever_changing_spew_folds_beyond_the_key_cap():
    signals = AppLogSignals("j", max_pending=4)
    for i in range(100):
        signals.feed(f"h:1:2 [0] misc/socket.cc:71 NCCL WARN socketProgress: Connection closed by remote peer "
                     f"gpu-{chr(97 + i % 26)}{chr(97 + i // 26)}<36138>", T0)
    events = signals.drain(T0)
    assert len(events) == 5 and sum(e.count for e in events) == 100
    assert [e.peer for e in events if e.count > 1] == [None]  # the overflow names no peer


def test_followed_log_raises_events_for_its_job_and_counts_them(tmp_path):
    path = tmp_path / "train.log"
    path.write_text("")
    c = make(log_files=[{"path": str(path), "format": "megatron", "job": "4242", "rank": 0}])
    c.collect(T0)
    append(path, (FIXTURES / "nccl-warn.log").read_text() + (FIXTURES / "cuda-errors.log").read_text()
           + (FIXTURES / "lookalikes.log").read_text())
    col = c.collect(T0 + 1)
    kinds = sorted((e.kind, e.peer or "", e.count) for e in col.events)
    assert kinds == [("cuda_error", "", 1), ("cuda_error", "", 1), ("cuda_error", "", 1), ("cuda_error", "", 1),
                     ("nccl_warn", "", 1), ("nccl_warn", "", 1), ("nccl_warn", "10.10.1.3", 1),
                     ("nccl_warn", "10.216.210.236", 3), ("nccl_warn", "fe80::966d:ae03:8b:df78%ib0", 1)]
    assert {e.job for e in col.events} == {"4242"}
    assert value(col.samples, "vigil_training_log_signals_total", path=str(path), kind="nccl_warn") == 7
    assert value(col.samples, "vigil_training_log_signals_total", path=str(path), kind="cuda_error") == 4
    assert value(col.samples, "vigil_training_log_signals_total", path=str(path), kind="nccl_timeout") == 0
    # The lookalike Megatron line in the same log is still progress.
    assert [r.last_step for r in col.report["ranks"]] == [100]
    append(path, (FIXTURES / "nccl-warn.log").read_text())  # the same lines again, within the interval
    assert c.collect(T0 + 2).events == []
    later = c.collect(T0 + 1 + FORWARD_INTERVAL_SECONDS)
    assert sum(e.count for e in later.events) == 7

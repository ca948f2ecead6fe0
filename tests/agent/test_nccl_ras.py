"""NCCL RAS reports in a followed log, against real `ncclras` output: the processes and ranks RAS
has no data from or considers dead become nccl_ras events naming their node; MISMATCH outliers
(possibly the ranks ahead) do not; hostile and broken lines are refused and counted by reason."""

from __future__ import annotations

from pathlib import Path

from tests.agent.collectors.test_training import T0, append, make, value
from vigil.agent.app_log import AppLogSignals, match_line
from vigil.agent.nccl_ras import MAX_DETAIL_LINES, REFUSALS, RasReportReader, valid_host

FIXTURES = Path(__file__).parent.parent / "fixtures" / "nccl"


def read(name: str) -> tuple[list[tuple[str, int | None, str | None]], dict[str, int]]:
    reader = RasReportReader()
    found = []
    for line in (FIXTURES / name).read_text().splitlines():
        _, sig = reader.feed(line)
        if sig is not None:
            found.append((sig.section, sig.rank, sig.host))
    return found, reader.refused


def test_a_real_incomplete_report_names_the_missing_process_and_rank_and_their_node():
    found, refused = read("ras-nccl-1762-incomplete.txt")
    assert found == [("missing_process", None, "10.4.109.13"), ("missing_rank", 1, "10.4.109.13")]
    assert set(refused.values()) == {0}
    signals = AppLogSignals("4242")
    for line in (FIXTURES / "ras-nccl-1762-incomplete.txt").read_text().splitlines():
        signals.feed(line, T0)
    events = signals.drain(T0)
    assert [(e.kind, e.rank, e.peer, e.job, e.urgent) for e in events] == [
        ("nccl_ras", None, "10.4.109.13", "4242", False), ("nccl_ras", 1, "10.4.109.13", "4242", False)]
    assert events[1].message == ("NCCL RAS: no data from rank 1, process 60004 on node 10.4.109.13 (GPU 0), "
                                 "of communicator b3398875b8b2a063")
    assert signals.matched["nccl_ras"] == 2


def test_mismatch_outliers_are_not_read_they_may_be_the_ranks_ahead():
    found, refused = read("ras-nccl-1911-mismatch.txt")
    assert found == [] and set(refused.values()) == {0}


def test_dead_processes_unknown_ranks_and_hostile_lines():
    found, refused = read("ras-handwritten-dead.txt")
    assert found == [("dead", None, "10.0.0.7"), ("missing_rank", 11, "10.0.0.7"), ("missing_rank", 12, None),
                     ("missing_process", None, "10.0.0.9")]
    # rank 1057455228 (issue 1762's real output), host "gpu-7;reboot", a training line after a lone
    # "DEAD", and a detail line with text NCCL never prints (the section ends: "Process 79" is not read).
    assert refused == {"ras_malformed": 2, "ras_bad_host": 1, "ras_bad_rank": 1, "ras_too_many": 0}


def test_a_heading_with_a_prefix_or_without_its_count_line_is_not_a_section():
    reader = RasReportReader()
    for line in ("[rank0]: INCOMPLETE", "  Missing communicator data from 1 job process",
                 "  Process 1 on node 10.0.0.1 managing GPU 0"):
        assert reader.feed(line) == (False, None)
    assert reader.feed("INCOMPLETE") == (True, None)
    # A line that is not the count line is refused and read as an ordinary line: an NCCL WARN still counts.
    warn = "h:1:2 [0] misc/socket.cc:71 NCCL WARN socketProgress: Connection closed by remote peer 10.0.0.3<1>"
    assert reader.feed(warn) == (False, None) and reader.refused["ras_malformed"] == 1
    signals = AppLogSignals("j")
    assert [signals.feed(line, T0) for line in ("DEAD", warn)] == [None, "nccl_warn"]


def test_a_section_listing_more_than_nccl_ever_prints_is_cut():
    reader = RasReportReader()
    reader.feed("DEAD")
    reader.feed("  99 job processes are considered dead (unreachable via the RAS network)")
    signals = [reader.feed(f"  Process {i + 1} on node 10.0.{i // 250}.{i % 250 + 1} managing GPU 0")[1]
               for i in range(MAX_DETAIL_LINES + 5)]
    assert sum(s is not None for s in signals) == MAX_DETAIL_LINES
    assert reader.refused["ras_too_many"] == 1


def test_hosts_are_addresses_or_dns_names():
    assert all(valid_host(h) for h in ("10.4.109.13", "fe80::966d:ae03:8b:df54%ib0", "gpu-7", "gpu-7.cluster.example"))
    assert not any(valid_host(h) for h in ("gpu-7;reboot", "-x", "a" * 254, "$(id)", "a..b"))


def test_nccl_connect_lines_name_their_peer_and_free_text_ranks_are_not_rank_tags():
    lines = (FIXTURES / "nccl-warn-connect.log").read_text().splitlines()
    found = [(s.kind, s.rank, s.peer) for s in map(match_line, lines) if s is not None]
    assert found == [("nccl_warn", None, "10.0.0.2"), ("nccl_warn", None, None), ("nccl_warn", None, "node1"),
                     ("nccl_warn", None, None)]


def test_followed_log_counts_ras_refusals_by_reason(tmp_path):
    path = tmp_path / "ras.log"
    path.write_text("")
    c = make(log_files=[{"path": str(path), "format": "megatron", "job": "4242", "rank": 0}])
    c.collect(T0)
    append(path, (FIXTURES / "ras-handwritten-dead.txt").read_text()
           + (FIXTURES / "ras-nccl-1911-mismatch.txt").read_text())
    col = c.collect(T0 + 1)
    assert sorted((e.kind, -1 if e.rank is None else e.rank, e.peer or "") for e in col.events) == [
        ("nccl_ras", -1, "10.0.0.7"), ("nccl_ras", -1, "10.0.0.9"), ("nccl_ras", 11, "10.0.0.7"), ("nccl_ras", 12, "")]
    assert value(col.samples, "vigil_training_log_signals_total", path=str(path), kind="nccl_ras") == 4
    got = {r: value(col.samples, "vigil_training_log_errors_total", path=str(path), reason=r) for r in REFUSALS}
    assert got == {"ras_malformed": 2, "ras_bad_host": 1, "ras_bad_rank": 1, "ras_too_many": 0}


def test_a_watchdog_timeout_carries_its_rank_and_the_collective_it_waited_in():
    line = (FIXTURES.parent / "app-signals" / "torch-nccl-timeout.log").read_text().splitlines()[0]
    sig = match_line(line)
    assert sig is not None and (sig.kind, sig.rank, sig.peer) == ("nccl_timeout", 0, None)
    assert "SeqNum=" in sig.message and "OpType=" in sig.message

"""Megatron-LM --log-straggler reports: recorded real lines (tests/fixtures/training-logs/PROVENANCE.md)."""

from pathlib import Path

import pytest

from vigil.agent.straggler_log import parse_straggler_line

LINES = (Path(__file__).resolve().parents[1] / "fixtures" / "training-logs" / "megatron-straggler.log"
         ).read_text().splitlines()


def test_readme_report_names_the_slowest_rank_by_throughput():
    report = parse_straggler_line(LINES[0])
    assert report is not None
    rtt = report.low["round_trip_seconds"]
    assert rtt.rank == 8 and rtt.value == pytest.approx(3.45308)
    assert report.high["round_trip_seconds"].rank == 0
    assert report.low["throughput_tflops"].value == pytest.approx(296.02) and report.low["throughput_tflops"].rank == 0
    assert report.high["sm_clock_mhz"].value == 1980.0 and report.low["sm_clock_mhz"].rank == 28
    assert report.high["data_seconds"].value == pytest.approx(0.03465) and report.high["data_seconds"].rank == 3
    slowest = report.slowest()
    assert slowest is not None
    rank, slower = slowest
    assert rank == 0 and slower == pytest.approx(1 - 296.02 / 297.32)


def test_bottom_and_top_lines():
    bottom = parse_straggler_line(LINES[1])
    top = parse_straggler_line(LINES[2])
    assert bottom is not None and [(e.rank, e.value) for e in bottom.bottom] == [
        (0, 296.02), (2, 296.17), (1, 296.23), (4, 296.23)]
    assert top is not None and [e.rank for e in top.top] == [15, 11, 12, 8]


def test_field_run_report_with_a_real_straggler():
    # Evo 2 40B on 128 nodes: rank 30 delivers 8% less than rank 13 and has the longest round trip.
    report = parse_straggler_line(LINES[3])
    assert report is not None
    slowest = report.slowest()
    assert slowest is not None
    rank, slower = slowest
    assert rank == 30 and slower == pytest.approx(1 - 560.82 / 608.83)
    assert report.high["round_trip_seconds"].rank == 30


def test_other_lines_are_not_reports():
    for line in (" [2024-05-02 10:11:12] iteration      100/  500000 | elapsed time per iteration (ms): 1234.5 |",
                 "MnRtt/Rnk: nan/3", "", "MnRtt/Rnk: 12ms/x"):
        assert parse_straggler_line(line) is None, line

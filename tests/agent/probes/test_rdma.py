"""agent/probes/rdma.py: ib_write_bw's real output (tests/fixtures/perftest/, provenance there) parsed
and judged against the port's line rate from sysfs; the server and client command lines; perftest
not installed, a failing run, output in the wrong units, no partner."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest

from vigil.agent.probes import rdma
from vigil.agent.probes.context import ProbeContext, ProbesConfig
from vigil.contract.wire import ProbeGroup, check

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
PERFTEST = FIXTURES / "perftest"
H100_SYSFS = FIXTURES / "sysfs" / "h100"  # mlx5_0, mlx5_1: 400 Gb/sec (4X NDR); mlx5_bond_0: 200 Gb/sec (2X NDR)


class Commands:
    """The command seam: answers every ib_write_bw with ``output`` (or raises ``error``), records argv."""

    def __init__(self, output: str = "", error: BaseException | None = None) -> None:
        self.output, self.error = output, error
        self.calls: list[tuple[list[str], float]] = []

    def __call__(self, argv: Sequence[str], timeout: float) -> str:
        self.calls.append((list(argv), timeout))
        if self.error is not None:
            raise self.error
        return self.output


def context(run: Commands, sysfs: Path = H100_SYSFS, group: ProbeGroup | None = None,
            **config: float) -> ProbeContext:
    group = group or ProbeGroup(group="r-1", partner="10.0.0.2")
    return ProbeContext(config=ProbesConfig(**config), gpus=[], nvml=None, engine=None, run=run,  # type: ignore[arg-type]
                        clock=lambda: 100.0, deadline=400.0, group=group, sysfs_root=sysfs)


def sysfs_with(tmp_path: Path, rates: dict[str, str]) -> Path:
    for hca, rate in rates.items():
        port = tmp_path / "class" / "infiniband" / hca / "ports" / "1"
        port.mkdir(parents=True)
        (port / "rate").write_text(rate + "\n")
    return tmp_path


def test_the_real_ndr_output_parses_past_perftests_warning_inside_the_table() -> None:
    row = rdma.parse_write_bw((PERFTEST / "ib_write_bw_ndr_client.txt").read_text())
    assert (row.message_bytes, row.iterations, row.peak_gbit, row.average_gbit) == (65536, 5000, 392.38, 392.34)


def test_a_duration_run_with_tabs_parses() -> None:
    row = rdma.parse_write_bw((PERFTEST / "ib_write_bw_duration_small_messages.txt").read_text())
    assert (row.message_bytes, row.peak_gbit, row.average_gbit, row.msg_rate_mpps) == (8, 0.0, 0.48, 7.498617)


def test_output_in_mb_per_sec_is_refused_not_misread() -> None:
    with pytest.raises(rdma.Unparsable, match="MB/sec"):
        rdma.parse_write_bw((PERFTEST / "ib_write_bw_mb_per_sec_truncated.txt").read_text())


def test_each_hca_runs_as_client_of_the_partner_and_passes_near_line_rate() -> None:
    run = Commands((PERFTEST / "ib_write_bw_ndr_client.txt").read_text())
    results = rdma.run(context(run, rdma_seconds=5))
    assert [c[0] for c in run.calls] == [
        ["ib_write_bw", "-d", hca, "-p", str(18515 + i), "--report_gbits", "-D", "5", "10.0.0.2"]
        for i, hca in enumerate(["mlx5_0", "mlx5_1", "mlx5_bond_0"])]
    assert all(timeout == 5 + rdma.CONNECT_SECONDS for _, timeout in run.calls)
    first = results[0]
    assert (first.status, first.reason, first.value, first.unit) == ("pass", "ok", 392.34, "gbit_per_s")
    assert first.metrics["line_rate_gbit"] == 400.0
    assert first.metrics["ratio"] == pytest.approx(392.34 / 400)
    assert first.detail.startswith("mlx5_0 (client of 10.0.0.2)")
    assert [check(r) for r in results] == results  # what the aggregator will decode


def test_below_line_rate_fails_with_the_ratio(tmp_path: Path) -> None:
    sysfs = sysfs_with(tmp_path, {"mlx5_0": "100 Gb/sec (4X EDR)"})
    run = Commands((PERFTEST / "ib_write_bw_duration_small_messages.txt").read_text())
    [result] = rdma.run(context(run, sysfs))
    assert (result.status, result.reason, result.value) == ("fail", "below_line_rate", 0.48)
    assert result.metrics["ratio"] == pytest.approx(0.0048)
    assert "below 90%" in result.detail


def test_a_lookalike_just_above_the_floor_passes(tmp_path: Path) -> None:
    sysfs = sysfs_with(tmp_path, {"mlx5_0": "400 Gb/sec (4X NDR)"})
    run = Commands((PERFTEST / "ib_write_bw_ndr_client.txt").read_text())
    [result] = rdma.run(context(run, sysfs, rdma_min_line_rate_ratio=0.98))  # 392.34 / 400 = 0.981
    assert (result.status, result.reason) == ("pass", "ok")


def test_the_server_side_waits_for_the_client_and_without_a_table_is_skipped_served(tmp_path: Path) -> None:
    sysfs = sysfs_with(tmp_path, {"mlx5_0": "400 Gb/sec (4X NDR)"})
    run = Commands("\n************************************\n* Waiting for client to connect... *\n")
    [result] = rdma.run(context(run, sysfs, group=ProbeGroup(group="r-1", serve=True)))
    argv, timeout = run.calls[0]
    assert argv == ["ib_write_bw", "-d", "mlx5_0", "-p", "18515", "--report_gbits", "-D", "5"]
    assert timeout == 300.0  # the deadline's remainder
    assert (result.status, result.reason) == ("skipped", "served")


def test_not_installed_is_skipped_once_not_per_hca() -> None:
    run = Commands(error=FileNotFoundError(2, "No such file or directory", "ib_write_bw"))
    results = rdma.run(context(run))
    assert [(r.status, r.reason) for r in results] == [("skipped", "not_installed")]


def test_a_failed_run_and_a_hang_are_errors() -> None:
    failed = rdma.run(context(Commands(error=subprocess.CalledProcessError(
        1, "ib_write_bw", output="", stderr=" Couldn't connect to 10.0.0.2:18515"))))
    assert (failed[0].status, failed[0].reason) == ("error", "command_failed")
    assert "Couldn't connect" in failed[0].detail
    hung = rdma.run(context(Commands(error=subprocess.TimeoutExpired("ib_write_bw", 35))))
    assert (hung[0].status, hung[0].reason) == ("error", "timeout")


def test_a_client_without_a_table_is_an_error_and_no_partner_is_refused(tmp_path: Path) -> None:
    sysfs = sysfs_with(tmp_path, {"mlx5_0": "400 Gb/sec (4X NDR)"})
    [garbled] = rdma.run(context(Commands("ib_write_bw: unrecognized option\n"), sysfs))
    assert (garbled.status, garbled.reason) == ("error", "unparsable")
    [alone] = rdma.run(context(Commands(), sysfs, group=ProbeGroup(group="r-1")))
    assert (alone.status, alone.reason) == ("error", "no_group")


def test_a_node_without_hcas_is_skipped(tmp_path: Path) -> None:
    run = Commands()
    assert [(r.status, r.reason) for r in rdma.run(context(run, tmp_path))] == [("skipped", "no_hca")]
    assert run.calls == []

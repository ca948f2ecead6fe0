"""dcgm_diag: real dcgmi diag outputs (tests/fixtures/dcgm/, README there names each source) parse
to the right verdicts through the command seam; a failing run's non-zero exit is read, not
dropped; dcgmi absent is skipped; output with no test in it is an error, not a pass."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from vigil.agent.probes import dcgm
from vigil.agent.probes.context import ProbesConfig

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "dcgm"


def recorded(name: str, exit_code: int = 0):
    text = (FIXTURES / name).read_text()
    calls = []

    def run(argv, timeout_seconds):
        calls.append((list(argv), timeout_seconds))
        if exit_code:  # dcgmi exits non-zero when a test fails
            raise subprocess.CalledProcessError(exit_code, list(argv), output=text, stderr="")
        return text

    return run, calls


def test_a_passing_run_passes_and_names_level_and_gpus(make_ctx):
    run, calls = recorded("dcgmi-4.4.2-r2-pass-1gpu.txt")
    [r] = dcgm.run(make_ctx(None, None, [0], run=run, config=ProbesConfig(dcgm_level=2), deadline=600.0))
    assert r.status == "pass" and r.metrics["tests_passed"] == 3 and r.metrics["tests_failed"] == 0
    assert "DCGM 4.4.2" in r.detail
    argv, timeout = calls[0]
    assert argv == ["dcgmi", "diag", "-r", "2", "-i", "0"] and 0 < timeout <= 600.0


@pytest.mark.parametrize(("name", "failing"), [
    ("dcgmi-4.4.1-r2-pcie-fail-b200.txt", "pcie: There was an internal error during the test"),
    ("dcgmi-3.3.8-r3-cuda-init-fail-h100.txt", "GPU Memory (all GPUs): GPU 0 Error using CUDA API cuInit"),
    ("dcgmi-r2-fragment-thermal-fail.txt", "GPU Memory (GPU 0): GPU 0 Thermal violations totaling 13.3 seconds"),
])
def test_failing_runs_fail_naming_the_test_its_gpus_and_why(make_ctx, name, failing):
    run, _ = recorded(name, exit_code=226)
    [r] = dcgm.run(make_ctx(None, None, [0, 1], run=run))
    assert r.status == "fail" and r.reason == "diag_failed" and r.metrics["tests_failed"] == 1
    assert failing in r.detail


def test_the_3x_table_counts_skips_and_keeps_info_rows_off_the_verdict():
    table = dcgm.parse_diag_table((FIXTURES / "dcgmi-3.3.8-r3-cuda-init-fail-h100.txt").read_text())
    assert table.version == "3.3.8"
    by_name = {t.name: t for t in table.tests}
    assert by_name["PCIe"].result == "Skip" and not by_name["PCIe"].failed
    assert by_name["Persistence Mode"].result == "Pass" and not by_name["Persistence Mode"].failed
    assert by_name["Persistence Mode"].messages[0].startswith('Persistence mode for GPU 0 is disabled. Enable')
    assert len(by_name["GPU Memory"].messages) == 8


def test_a_per_gpu_fail_row_fails_a_test_whose_own_word_is_pass():
    table = dcgm.parse_diag_table((FIXTURES / "dcgmi-r2-fragment-thermal-fail.txt").read_text())
    [test] = table.tests
    assert test.result == "Pass" and test.failed_gpus == [0] and test.failed


def test_an_error_row_fails_the_run():
    text = """+---------------------------+------------------------------------------------+
| Diagnostic                | Result                                         |
+===========================+================================================+
|-----  Deployment  --------+------------------------------------------------|
| Error                     | GPU 3 has uncorrectable memory errors and row  |
|                           |  remappings are pending                        |
"""
    r = dcgm.verdict(dcgm.parse_diag_table(text), 3, 1.0)
    assert r.status == "fail" and "GPU 3 has uncorrectable memory errors and row remappings are pending" in r.detail


def test_dcgmi_not_installed_is_skipped(make_ctx):
    [r] = dcgm.run(make_ctx(None, None, [0]))
    assert r.status == "skipped" and r.reason == "not_installed"


def test_a_host_engine_that_does_not_answer_is_an_error_not_a_pass(make_ctx):
    def run(argv, timeout_seconds):
        raise subprocess.CalledProcessError(
            255, list(argv), output="Error: unable to establish a connection to the specified host: localhost\n")

    [r] = dcgm.run(make_ctx(None, None, [0], run=run))
    assert r.status == "error" and r.reason == "unparseable" and "unable to establish" in r.detail


def test_a_timeout_is_an_error(make_ctx):
    def run(argv, timeout_seconds):
        raise subprocess.TimeoutExpired(list(argv), timeout_seconds)

    [r] = dcgm.run(make_ctx(None, None, [0], run=run))
    assert r.status == "error" and r.reason == "timeout"

"""`vigil sim`: exit codes, the JSON object, the report page."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import yaml

from tests.sim.conftest import next_report, raw
from vigil.cli import main
from vigil.cli.sim_cmd import ProgressBar, ProgressLines
from vigil.sim.scenario import parse_scenario


def _write(tmp_path: Path, data: dict, name: str = "s.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def test_json_object_and_exit_zero_when_met(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, raw("kernel-xid-79"))
    assert main(["sim", "--scenario", str(path), "--json", "--duration", "120"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("decisions", "expectations", "precision", "recall", "false_drains", "detection_latency_seconds",
                "simulated_seconds", "wall_seconds", "pass"):
        assert key in out
    assert out["pass"] is True and out["simulated_seconds"] == 120.0
    # The Xid is logged at 90 s and read at node-0005's next report (its agent's own phase).
    read = next_report(parse_scenario(raw("kernel-xid-79")), "node-0005", 90)
    assert out["expectations"][0]["met"] and out["expectations"][0]["latency_seconds"] == round(read - 90, 3)
    assert set(out["detection_latency_seconds"]) == {"p50", "p95", "max"}


def test_exit_one_when_an_expectation_is_missed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = raw("kernel-xid-79")
    data["expect"][0]["node"] = "node-0006"  # the Xid is on node-0005
    assert main(["sim", "--scenario", str(_write(tmp_path, data)), "--duration", "120"]) == 1
    text = capsys.readouterr().out
    assert "FAIL" in text and "MISSED node-0006" in text


def test_exit_two_and_key_path_on_a_bad_scenario(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = raw("kernel-xid-79")
    data["fleet"]["nodez"] = 3
    assert main(["sim", "--scenario", str(_write(tmp_path, data))]) == 2
    assert "fleet.nodez: unknown key" in capsys.readouterr().err


def test_report_page_with_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, raw("kernel-xid-79"))
    out_dir = tmp_path / "report"
    assert main(["sim", "--scenario", str(path), "--duration", "120", "--report", str(out_dir)]) == 0
    page = (out_dir / "index.html").read_text()
    assert "PASS" in page and "node-0005" in page and "reboot_node" in page
    for png in ("fleet.png", "job-0.png"):
        assert f'src="{png}"' in page or f"src='{png}'" in page
        assert (out_dir / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "report:" in capsys.readouterr().out


def test_progress_bar_draws_and_ends_with_a_newline() -> None:
    stream = io.StringIO()
    bar = ProgressBar(stream, width=10)
    bar(50, 100, 2)
    bar(100, 100, 3)
    text = stream.getvalue()
    assert "[#####.....]" in text and "[##########]" in text and text.endswith("\n")
    assert "decisions: 3" in text


def test_json_stdout_stays_one_object_while_progress_lines_go_to_stderr(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, raw("kernel-xid-79"))
    assert main(["sim", "--scenario", str(path), "--json", "--duration", "120", "--progress-every", "0"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)  # nothing but the object on stdout
    lines = captured.err.splitlines()
    assert len(lines) > 10 and all(line.startswith("vigil sim: ") for line in lines)
    assert lines[-1].startswith("vigil sim: 120/120 simulated s (100.0%), ")
    assert f"decisions so far: {len(out['decisions'])}," in lines[-1]


def test_progress_lines_are_at_most_one_per_interval_of_wall_time_and_always_the_last() -> None:
    wall = [100.0]
    stream = io.StringIO()
    lines = ProgressLines(stream, every_seconds=5.0, clock=lambda: wall[0])
    for step in range(1, 13):  # 12 simulated steps, 1 s of wall time each
        wall[0] += 1.0
        lines(step * 100.0, 1200.0, step // 4)
    text = stream.getvalue().splitlines()
    assert text == ["vigil sim: 500/1,200 simulated s (41.7%), decisions so far: 1, 5 s wall",
                    "vigil sim: 1,000/1,200 simulated s (83.3%), decisions so far: 2, 10 s wall",
                    "vigil sim: 1,200/1,200 simulated s (100.0%), decisions so far: 3, 12 s wall"]


def test_an_isolation_is_reported_with_its_tests_against_the_information_bound(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "--scenario", str(_write(tmp_path, raw("repaired-64-three-bad")))]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "isolation " in line]
    assert len(lines) == 1
    assert "(done): 3 faulty of 64 (node-0005, node-0026, node-0049) in " in lines[0]
    assert "tests (information bound 15.35, " in lines[0]

"""``vigil xid scan`` and ``vigil xid explain`` through the real command table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vigil.cli import main

FIXTURES = Path(__file__).parent.parent / "fixtures" / "kernel-log"


def scan_json(path: Path, capsys: pytest.CaptureFixture[str]) -> list[dict[str, object]]:
    assert main(["xid", "scan", str(path), "--json"]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_scan_json_nvsentinel_samples(capsys: pytest.CaptureFixture[str]) -> None:
    records = scan_json(FIXTURES / "nvsentinel-kernel-log-samples.txt", capsys)
    xids = [(r["pci_bus_id"], r["code"], r["action"]) for r in records if r["kind"] == "xid"]
    assert xids == [
        ("0018:01:00", 149, "reset_gpu"),  # NETIR_LINK_EVT Fatal
        ("0000:b5:00", 13, "observe"),
        ("0000:b5:00", 13, "observe"),
        ("0003:00:00", 74, "reset_gpu"),
        ("0000:66:00", 32, "observe"),
        ("0008:01:00", 154, "reset_gpu"),  # "to 0x1 (GPU Reset Required)"
        ("0002:00:00", 119, "reset_gpu"),
        ("0001:00:00", 145, "reset_gpu"),  # RLW_REMAP Fatal
        ("0000:b5:00", 31, "observe"),
    ]
    sxids = [(r["pci_bus_id"], r["code"], r["action"]) for r in records if r["kind"] == "sxid"]
    assert sxids == [("0000:c3:00", 24007, "reboot_node"), ("0000:06:00", 20009, "observe"),
                     ("0000:c1:00", 28006, "observe"), ("0004:00:00", 26008, "alert")]
    assert [r["kind"] for r in records].count("mlx5_error") == 5
    lost = [r for r in records if r["kind"] == "gpu_lost"]
    assert [(r["pci_bus_id"], r["action"]) for r in lost] == [("0000:b3:00", "reboot_node")]
    assert records[6]["ts"] == "16450076.435595"
    assert all({"pci_bus_id", "code", "action", "ts", "text", "kind"} <= r.keys() for r in records)


def test_scan_json_gpud_dmesg_T(capsys: pytest.CaptureFixture[str]) -> None:
    records = scan_json(FIXTURES / "gpud-dmesg-T-xid119.log", capsys)
    assert [(r["pci_bus_id"], r["code"], r["action"]) for r in records] == [("0000:9b:00", 119, "reset_gpu")] * 5
    assert records[3]["ts"] == "Sun Feb 23 16:27:12 2025"


def test_scan_json_gpud_iso(capsys: pytest.CaptureFixture[str]) -> None:
    records = scan_json(FIXTURES / "gpud-dmesg-decode-iso-xid13-xid43.log", capsys)
    assert [r["code"] for r in records] == [13] * 16 + [43]
    assert {r["pci_bus_id"] for r in records} == {"0000:38:00"}
    assert records[0]["ts"] == "2025-01-21T04:41:44,283302+00:00"


def test_scan_text_prints_time_bus_code_action_and_text(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["xid", "scan", str(FIXTURES / "gpud-dmesg-T-xid119.log")]) == 0
    out, err = capsys.readouterr()
    first = out.splitlines()[0].split("\t")
    assert first[:4] == ["Sun Feb 23 16:24:18 2025", "0000:9b:00", "Xid 119", "reset_gpu"]
    assert first[4].startswith("Timeout after 6s")
    assert "5 event(s)" in err


def test_scan_of_a_log_without_gpu_faults_prints_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    assert scan_json(FIXTURES / "azurehpc-1dev_6flap_syslog", capsys) == []


def test_scan_counts_unparsable_lines_on_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "mixed.log"
    log.write_bytes(b"[ 1.0] NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus.\n"
                    b"[ 2.0] NVRM: Xid (PCI:0000:3b:00): not-a-code\n"
                    b"[ 3.0] NVRM: Xid \xff\xfe\n")
    assert main(["xid", "scan", str(log), "--json"]) == 0
    out, err = capsys.readouterr()
    assert [json.loads(line)["code"] for line in out.splitlines()] == [79]
    assert "skipped 2 unparsable line(s)" in err and "malformed_xid: 1" in err and "undecodable: 1" in err


def test_scan_unreadable_file_fails_with_a_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["xid", "scan", str(tmp_path / "missing.log")]) == 1
    out, err = capsys.readouterr()
    assert out == "" and "cannot read" in err and "missing.log" in err
    assert main(["xid", "scan", str(tmp_path)]) == 1  # a directory
    assert "cannot read" in capsys.readouterr().err


def test_explain_known_and_unknown_codes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["xid", "explain", "79"]) == 0
    out = capsys.readouterr().out
    assert "ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS" in out and "reboot_node" in out and "RESTART_BM" in out
    assert main(["xid", "explain", "999", "--json"]) == 0
    entry = json.loads(capsys.readouterr().out)
    assert (entry["code"], entry["category"], entry["action"]) == (999, "unknown", "alert")


def test_explain_rejects_a_non_integer(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["xid", "explain", "seventy-nine"]) == 2
    assert "not an Xid code" in capsys.readouterr().err

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


def test_scan_folds_companion_lines_into_one_event_per_fault(capsys: pytest.CaptureFixture[str]) -> None:
    # Xid 79 and the one-line notice for the same GPU: one reboot_node, not two.
    records = scan_json(FIXTURES / "blog-xid79-fallen-notice-syslog.log", capsys)
    assert [(r["kind"], r["code"], r["action"]) for r in records] == [("xid", 79, "reboot_node"), ("xid", 44, "alert")]
    # SXid headlines with their Severity/Data lines: one event per link (plus one orphan Data line).
    records = scan_json(FIXTURES / "nvtrust-124-sxid-details.log", capsys)
    assert [(r["code"], r.get("severity"), r["action"]) for r in records] == [
        (22013, None, "observe"), (22013, "Non-fatal", "observe"), (22013, "Non-fatal", "observe"),
        (22013, "Non-fatal", "observe")]
    # An mlx5 health dump: one event per PCI function that lost health.
    records = scan_json(FIXTURES / "lkml-mlx5-health-dump.log", capsys)
    assert [r["device"] for r in records] == [f"0000:0d:00.{fn}" for fn in (0, 2, 3, 4, 1, 5)]
    assert main(["xid", "scan", str(FIXTURES / "lkml-mlx5-health-dump.log")]) == 0
    assert "6 event(s)" in (err := capsys.readouterr().err) and "16 companion line(s) folded" in err


def test_scan_judges_an_sxid_without_severity_word_by_the_fabric_manager_catalog(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # gpud PR 338's real line: a detail-only SXid 12028 line (Fabric Manager guide D.4, non-fatal
    # with a recovery step): an alert, not an action.
    records = scan_json(FIXTURES / "gpud-pr338-sxid12028-data-iso.log", capsys)
    assert [(r["code"], r["action"]) for r in records] == [(12028, "alert")]
    log = tmp_path / "sxid.log"
    log.write_text("[ 5.0] nvidia-nvswitch2: SXid (PCI:0000:05:00.0): 24007, Link 30 sourcetrack timeout error\n"
                   "[ 6.0] nvidia-nvswitch2: SXid (PCI:0000:05:00.0): 12020, egress sequence ID error\n"
                   "[ 7.0] nvidia-nvswitch2: SXid (PCI:0000:05:00.0): 22013, Link 3 Minion Link DLREQ interrupt\n"
                   "[ 8.0] nvidia-nvswitch2: SXid (PCI:0000:05:00.0): 24007, Non-fatal, Link 30 the word wins\n")
    records = scan_json(log, capsys)
    assert [r["action"] for r in records] == ["reboot_node", "reboot_node", "observe", "observe"]


def test_scan_of_a_log_collected_from_many_hosts_equals_each_hosts_scan(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # pdsh -w node[1-N] dmesg prints "<host>: <line>", hosts interleaved. Every real log of
    # tests/fixtures/kernel-log plays one host.
    logs = sorted(p for p in FIXTURES.iterdir() if p.suffix in (".log", ".txt") or "syslog" in p.name)
    assert len(logs) >= 8
    per_host = {f"gpu-{n:03d}": log for n, log in enumerate(logs)}
    lines = {host: log.read_text().splitlines() for host, log in per_host.items()}
    collected: list[str] = []
    for i in range(max(len(v) for v in lines.values())):
        collected += [f"{host}: {host_lines[i]}" for host, host_lines in lines.items() if i < len(host_lines)]
    collected_log = tmp_path / "pdsh-dmesg.log"
    collected_log.write_text("\n".join(collected) + "\n")

    together = scan_json(collected_log, capsys)
    assert {r["host"] for r in together} <= set(per_host)
    total = 0
    for host, log in per_host.items():
        alone = [{k: v for k, v in r.items() if k != "host"} for r in scan_json(log, capsys)]
        mine = [{k: v for k, v in r.items() if k != "host"} for r in together if r["host"] == host]
        assert mine == alone, host
        total += len(alone)
    assert len(together) == total > 30
    # The text form leads with the host.
    assert main(["xid", "scan", str(collected_log)]) == 0
    first = capsys.readouterr().out.splitlines()[0].split("\t")
    assert first[0] in per_host and first[0] == together[0]["host"]


def test_scan_more_real_dmesg_T_logs(capsys: pytest.CaptureFixture[str]) -> None:
    # gpud PR 46 (dmesg --ctime): three Xid 13 lines of one exception and an Xid 109.
    records = scan_json(FIXTURES / "gpud-pr46-dmesg-ctime-xid13-109.log", capsys)
    assert [(r["code"], r["action"]) for r in records] == [(13, "observe")] * 3 + [(109, "reset_gpu")]
    # akash-network/support 244: "NVRM: GPU at PCI:...: GPU-<uuid>" lines are no fallen-off notice.
    records = scan_json(FIXTURES / "akash-244-dmesg-T-nvrm.log", capsys)
    assert [(r["kind"], r["pci_bus_id"], r["code"]) for r in records] == [
        ("xid", "0000:00:05", 43), ("xid", "0000:00:05", 43), ("xid", "0000:00:07", 31), ("xid", "0000:00:08", 94)]
    assert records[2]["ts"] == "Mon Aug  5 03:54:13 2024"


# The decode of the recorded real Xid 74 / NVLink5 lines (register patterns hand-decoded in
# tests/aggregator/test_xid_catalog_nvlink.py; provenance in tests/fixtures/kernel-log/PROVENANCE.md).
NVLINK_LINES = {
    "nvsentinel-kernel-log-samples.txt": [
        (149, 9, True, "NETIR_LINK_EVT/NETIR_LINK_DOWN", "RESET_GPU", "reset_gpu"),
        (74, 14, True, None, "WORKFLOW_NVLINK_ERR", "reset_gpu"),
        (145, 10, True, "RLW_REMAP", "RESET_GPU", "reset_gpu")],
    "gpud-pr1160-pr1174-nvlink5.log": [
        (144, 0, False, "SAW_MVB", "IGNORE", "observe"),
        (149, 0, True, "NETIR_LINK_EVT/NETIR_LINK_DOWN", "IGNORE", "observe"),
        (149, 0, True, "NETIR_LINK_EVT/NETIR_LINK_DOWN", "RESET_GPU", "reset_gpu"),
        (149, None, True, "NETIR/NETIR_INT", "RESET_GPU", "reset_gpu"),
        (145, 13, False, "RLW_RXPIPE", "IGNORE", "observe")],
    "gpud-xid-test-gb200-netir-154.log": [
        (149, link, True, "NETIR_LINK_EVT/NETIR_LINK_DOWN", "RESET_GPU", "reset_gpu") for link in (1, 1, 0, 15, 14)],
    "nvsentinel-doc022-xid74.log": [(74, 14, True, None, "WORKFLOW_NVLINK_ERR", "reset_gpu")],
    "hyperpod-doc-xid74-injected.log": [(74, 6, True, None, "WORKFLOW_NVLINK_ERR", "reset_gpu")],
}


@pytest.mark.parametrize("name", sorted(NVLINK_LINES))
def test_scan_decodes_the_recorded_nvlink_lines(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    records = scan_json(FIXTURES / name, capsys)
    decoded = [(r["code"], r["nvlink"]["link"], r["nvlink"]["fatal"], r["nvlink"]["unit"],  # type: ignore[index]
                r["nvlink"]["resolution"], r["action"]) for r in records if "nvlink" in r]  # type: ignore[index]
    assert decoded == NVLINK_LINES[name]
    # Every other Xid line carries no decode.
    assert all("nvlink" not in r for r in records if r["code"] not in (74, *range(144, 151)))


def test_scan_text_appends_the_decode(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["xid", "scan", str(FIXTURES / "gpud-pr1160-pr1174-nvlink5.log")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split("\t")[-1] == ("[link 0, non-fatal, unit SAW_MVB, resolution IGNORE, "
                                      "investigate: CONTACT_SUPPORT]")
    assert out[0].split("\t")[3] == "observe"


def test_scan_amdgpu_log_names_each_event_and_its_catalog_action(capsys: pytest.CaptureFixture[str]) -> None:
    records = scan_json(FIXTURES / "amdgpu" / "kernel-bugzilla-201957-reset-failed-soft-recovered.log", capsys)
    assert [(r["kind"], r["error"], r["action"]) for r in records] == [
        ("amdgpu", "ring_timeout", "observe"), ("amdgpu", "gpu_reset_begin", "observe"),
        ("amdgpu", "gpu_reset_failed", "reboot_node"), ("amdgpu", "ring_timeout_recovered", "observe"),
        ("amdgpu", "ring_timeout_recovered", "observe"), ("amdgpu", "ring_timeout", "observe"),
        ("amdgpu", "gpu_reset_begin", "observe")]
    assert main(["xid", "scan", str(FIXTURES / "amdgpu" / "incident-mi50-umc-ue.log")]) == 0
    assert "amdgpu ras_uncorrectable\treset_gpu" in capsys.readouterr().out

"""Kernel-log parsing on every prefix format and on the real logs in tests/fixtures/kernel-log."""

from __future__ import annotations

import io
import os
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from agent.kernel_log import (
    REASON_KMSG_RECORD,
    REASON_UNDECODABLE,
    REASON_XID,
    FileFollower,
    JournalReader,
    KernelEvent,
    KernelLogParser,
    KmsgReader,
    StreamReader,
    normalize_bus_id,
    split_prefix,
)

FIXTURES = Path(__file__).parent.parent / "fixtures" / "kernel-log"


def events_of(lines: list[str], *, raw_kmsg: bool = False) -> tuple[list[KernelEvent], list[str]]:
    parser = KernelLogParser(raw_kmsg=raw_kmsg)
    events, unparsed = [], []
    for line in lines:
        parsed = parser.feed(line)
        if parsed.event:
            events.append(parsed.event)
        if parsed.unparsed:
            unparsed.append(parsed.unparsed)
    return events, unparsed


def fixture_events(name: str) -> list[KernelEvent]:
    events, unparsed = events_of((FIXTURES / name).read_text().splitlines())
    assert unparsed == []
    return events


OLD = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus."
NEW = "NVRM: Xid (PCI:0000:3b:00): 13, pid='<unknown>', name=<unknown>, Graphics Exception: ESR 0x50df30=0x107000e"


@pytest.mark.parametrize(
    ("line", "ts_text"),
    [
        (f"6,1234,5678901,-;{OLD}", "5.678901"),
        (f"[ 1234.567890] {OLD}", "1234.567890"),
        (f"[Mon Jan  1 03:04:05 2024] {OLD}", "Mon Jan  1 03:04:05 2024"),
        (f"kern  :warn  : 2025-01-21T04:41:44,283302+00:00 {OLD}", "2025-01-21T04:41:44,283302+00:00"),
        (f"2024-01-01T03:04:05+0000 gpu-node-7 kernel: {OLD}", "2024-01-01T03:04:05+0000"),
        (f"2024-01-01T03:04:05.123456+00:00 gpu-node-7 kernel: [ 99.5] {OLD}", "2024-01-01T03:04:05.123456+00:00"),
        (f"Jan  1 03:04:05 gpu-node-7 kernel: [ 1234.567890] {OLD}", "Jan  1 03:04:05"),
        (f"kernel: [16450076.435595] {OLD}", "16450076.435595"),
        (OLD, ""),
    ],
)
def test_old_format_xid_in_every_prefix(line: str, ts_text: str) -> None:
    (ev,), unparsed = events_of([line])
    assert unparsed == []
    assert (ev.kind, ev.pci_bus_id, ev.code, ev.pid, ev.process) == ("xid", "0000:3b:00", 79, "1234", None)
    assert ev.text == "GPU has fallen off the bus."
    assert ev.ts_text == ts_text


def test_new_format_xid_strips_pid_and_name() -> None:
    (ev,), _ = events_of([f"[ 10.0] {NEW}"])
    assert (ev.code, ev.pid, ev.process) == (13, "<unknown>", "<unknown>")
    assert ev.text == "Graphics Exception: ESR 0x50df30=0x107000e"


def test_xid_with_numeric_pid_and_process_name() -> None:
    (ev,), _ = events_of(["NVRM: Xid (PCI:0000:66:00): 32, pid=2280636, name=train.3, Channel ID 0000000d"])
    assert (ev.code, ev.pid, ev.process, ev.text) == (32, "2280636", "train.3", "Channel ID 0000000d")


def test_kmsg_record_carries_its_sequence_number() -> None:
    parsed = KernelLogParser(raw_kmsg=True).feed(f"4,98765,5678901,-;{NEW}")
    assert parsed.seq == 98765
    assert parsed.event is not None and parsed.event.seq == 98765


def test_kmsg_continuation_lines_are_neither_events_nor_errors() -> None:
    parser = KernelLogParser(raw_kmsg=True)
    parsed = parser.feed(" SUBSYSTEM=pci")
    assert parsed.continuation and parsed.event is None and parsed.unparsed is None


def test_malformed_input_is_counted_not_fatal() -> None:
    events, unparsed = events_of(
        [
            "this is not a kmsg record",
            f"6,1,2,-;{OLD}",
            "6,2,3,-;NVRM: Xid (PCI:0000:3b:00): garbage",
            "6,3,4,-;NVRM: Xid \ufffd\ufffd",
        ],
        raw_kmsg=True,
    )
    assert [e.code for e in events] == [79]
    assert unparsed == [REASON_KMSG_RECORD, REASON_XID, REASON_UNDECODABLE]


def test_unrelated_lines_are_not_unparsed() -> None:
    events, unparsed = events_of(["[ 1.0] usb 1-1: new high-speed USB device", "NVRM: loading NVIDIA UNIX driver"])
    assert events == [] and unparsed == []


def test_nvml_and_kernel_bus_id_forms_normalise_to_one() -> None:
    assert normalize_bus_id("00000000:3B:00.0") == "0000:3b:00"
    assert normalize_bus_id("PCI:0000:3b:00") == "0000:3b:00"
    assert normalize_bus_id("0018:01:00.1") == "0018:01:00"
    with pytest.raises(ValueError):
        normalize_bus_id("3b")


def test_split_prefix_keeps_syslog_message() -> None:
    ts, msg, seq = split_prefix("Aug 17 06:18:01 jplc7eb7-vm-0 systemd-networkd[5398]: ib6: lost carrier")
    assert (ts, msg, seq) == ("Aug 17 06:18:01", "ib6: lost carrier", None)


def test_one_line_fallen_off_the_bus() -> None:
    (ev,), _ = events_of(["[ 5.0] NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus."])
    assert (ev.kind, ev.pci_bus_id, ev.code) == ("gpu_lost", "0000:3b:00", None)


# -- the real logs, counted by hand (tests/fixtures/kernel-log/PROVENANCE.md) -----------------


def test_nvsentinel_samples() -> None:
    events = fixture_events("nvsentinel-kernel-log-samples.txt")
    xids = [(e.pci_bus_id, e.code) for e in events if e.kind == "xid"]
    assert xids == [
        ("0018:01:00", 149), ("0000:b5:00", 13), ("0000:b5:00", 13), ("0003:00:00", 74), ("0000:66:00", 32),
        ("0008:01:00", 154), ("0002:00:00", 119), ("0001:00:00", 145), ("0000:b5:00", 31),
    ]
    sxids = [(e.device, e.pci_bus_id, e.code, e.severity) for e in events if e.kind == "sxid"]
    assert sxids == [
        ("nvidia-nvswitch0", "0000:c3:00", 24007, "Fatal"),
        ("nvidia-nvswitch0", "0000:06:00", 20009, "Non-fatal"),
        ("nvidia-nvswitch3", "0000:c1:00", 28006, "Non-fatal"),
        ("nvidia-nvswitch0", "0004:00:00", 26008, None),
    ]
    mlx5 = [(e.device, e.error) for e in events if e.kind == "mlx5_error"]
    assert mlx5 == [
        ("0000:03:00.0", "command_timeout"),
        ("0000:d2:00.0", "health_compromised"),
        ("0000:12:00.0", "pcie_power"),
        ("0000:5c:00.0", "module_error"),
        ("0000:41:00.1", "cable_unplugged"),
    ]
    lost = [(e.pci_bus_id, e.ts_text) for e in events if e.kind == "gpu_lost"]
    assert lost == [("0000:b3:00", "")]
    assert len(events) == 9 + 4 + 5 + 1
    xid154 = next(e for e in events if e.code == 154)
    assert xid154.text == "GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)"


def test_gpud_dmesg_T_xid_119() -> None:
    events = fixture_events("gpud-dmesg-T-xid119.log")
    assert [(e.kind, e.pci_bus_id, e.code) for e in events] == [("xid", "0000:9b:00", 119)] * 5
    assert [e.ts_text[11:19] for e in events] == ["16:24:18", "16:24:24", "16:24:30", "16:27:12", "16:30:13"]
    assert [e.process for e in events] == ["nvidia-smi"] * 3 + ["cache_mgr_main", "gpud"]
    assert events[0].text.startswith("Timeout after 6s of waiting for RPC response from GPU4 GSP!")


def test_gpud_dmesg_decode_iso_xid13_burst_and_xid43() -> None:
    events = fixture_events("gpud-dmesg-decode-iso-xid13-xid43.log")
    assert [e.code for e in events] == [13] * 16 + [43]
    assert {e.pci_bus_id for e in events} == {"0000:38:00"}
    assert events[-1].ts_text == "2025-01-21T04:41:44,287197+00:00"
    assert events[-1].text == "Ch 00000008"


def test_azurehpc_syslog_has_no_gpu_events() -> None:
    assert fixture_events("azurehpc-1dev_6flap_syslog") == []


# -- readers ---------------------------------------------------------------------------------


def test_file_follower_reads_appends_and_waits_for_whole_lines(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text("old line\n")
    follower = FileFollower(log, start="end")
    assert follower.read_lines(100) == []
    with log.open("a") as fh:
        fh.write("first\nsecond, half")
    assert follower.read_lines(100) == ["first"]
    with log.open("a") as fh:
        fh.write(" done\n")
    assert follower.read_lines(100) == ["second, half done"]
    follower.close()


def test_file_follower_survives_rotation_and_truncation(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text("a\n")
    follower = FileFollower(log, start="beginning")
    assert follower.read_lines(100) == ["a"]
    with log.open("a") as fh:
        fh.write("b\n")
    log.rename(tmp_path / "kern.log.1")
    log.write_text("c\n")
    assert follower.read_lines(100) == ["b", "c"]
    assert follower.rotations == 1
    log.write_text("")  # logrotate's copytruncate
    assert follower.read_lines(100) == []
    assert follower.truncations == 1
    with log.open("a") as fh:
        fh.write("d\n")
    assert follower.read_lines(100) == ["d"]
    with log.open("a") as fh:
        fh.write("a much longer line\n")
    assert follower.read_lines(100) == ["a much longer line"]
    log.write_text("e\n")  # truncated and rewritten shorter between two cycles
    assert follower.read_lines(100) == ["e"]
    assert follower.truncations == 2
    follower.close()


def test_file_follower_limits_a_cycle_and_keeps_the_rest(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text("".join(f"line {i}\n" for i in range(10)))
    follower = FileFollower(log, start="beginning")
    assert follower.read_lines(4) == [f"line {i}" for i in range(4)]
    assert follower.read_lines(4) == [f"line {i}" for i in range(4, 8)]
    assert follower.read_lines(4) == ["line 8", "line 9"]
    follower.close()


def test_file_follower_resumes_from_cursor_and_ignores_a_stale_one(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text("a\nb\n")
    first = FileFollower(log, start="beginning")
    assert first.read_lines(1) == ["a"]
    cursor = first.cursor()
    first.close()
    with log.open("a") as fh:
        fh.write("c\n")
    resumed = FileFollower(log, start="end", cursor=cursor)
    assert resumed.read_lines(100) == ["b", "c"]
    resumed.close()
    stale = FileFollower(log, start="end", cursor={**cursor, "inode": -1})
    assert stale.read_lines(100) == ["a", "b", "c"]
    stale.close()


def test_file_follower_missing_file_raises_oserror(tmp_path: Path) -> None:
    with pytest.raises(OSError, match="cannot open"):
        FileFollower(tmp_path / "nope").read_lines(10)


def test_kmsg_reader_on_a_fifo_returns_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "kmsg"
    os.mkfifo(fifo)
    writer_fd = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)  # keeps the FIFO open so reads get EAGAIN
    try:
        reader = KmsgReader(fifo)
        assert reader.read_lines(10) == []
        os.write(writer_fd, f"6,7,100,-;{OLD}\n".encode())
        assert reader.read_lines(10) == [f"6,7,100,-;{OLD}"]
        assert reader.read_lines(10) == []
        reader.close()
    finally:
        os.close(writer_fd)


def test_stream_reader_drains_what_is_available() -> None:
    reader = StreamReader(io.StringIO("x\ny\n"))
    lines: list[str] = []
    for _ in range(200):  # the reader thread fills the queue; poll without a timed assertion
        lines += reader.read_lines(10)
        if reader.ended:
            break
        time.sleep(0.005)
    assert [line.strip() for line in lines] == ["x", "y"]


class _FakeProcess:
    def __init__(self, text: str) -> None:
        self.stdout: io.StringIO | None = io.StringIO(text)
        self.pid = 4242
        self.terminated = False

    def terminate(self) -> None:
        self.terminated = True

    def wait(self, timeout: float | None = None) -> int:
        return 0

    def kill(self) -> None:
        raise AssertionError("terminate was enough")


def test_journal_reader_spawns_journalctl_and_stops_it() -> None:
    spawned: list[list[str]] = []
    proc = _FakeProcess(f"2024-01-01T03:04:05+0000 node kernel: {OLD}\n")

    def spawn(argv: Sequence[str]) -> _FakeProcess:
        spawned.append(list(argv))
        return proc

    reader = JournalReader(spawn=spawn)
    lines: list[str] = []
    for _ in range(200):
        lines += reader.read_lines(10)
        if lines:
            break
        time.sleep(0.005)
    assert spawned[0][:3] == ["journalctl", "-k", "-f"]
    (ev,), _ = events_of(lines)
    assert ev.code == 79
    reader.close()
    assert proc.terminated


def test_real_dev_kmsg_is_read_without_blocking() -> None:
    if not os.access("/dev/kmsg", os.R_OK):
        pytest.skip("/dev/kmsg is not readable here (needs CAP_SYSLOG or kernel.dmesg_restrict=0)")
    try:
        reader = KmsgReader("/dev/kmsg")
        first = reader.read_lines(100_000)
    except PermissionError as exc:
        pytest.skip(f"/dev/kmsg cannot be opened: {exc}")
    parser = KernelLogParser(raw_kmsg=True)
    parsed = [parser.feed(line) for line in first]
    records = [p for p in parsed if not p.continuation]
    assert records and all(p.unparsed is None for p in records)
    seqs = [p.seq for p in records if p.seq is not None]
    assert len(seqs) == len(records) and seqs == sorted(seqs)
    reader.read_lines(100_000)  # the ring buffer is drained: this returns at once
    reader.close()

"""Kernel-log parsing on every prefix format and on the real logs in tests/fixtures/kernel-log."""

from __future__ import annotations

import io
import os
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from vigil.agent.kernel_log import (
    FOLD_SPAN_LINES,
    MAX_HOSTS,
    REASON_KMSG_RECORD,
    REASON_UNDECODABLE,
    REASON_XID,
    KernelEvent,
    KernelLogParser,
    ParsedLine,
    normalize_bus_id,
)
from vigil.agent.kernel_log_prefix import split_line, split_prefix, timestamp_seconds
from vigil.agent.kernel_log_readers import JournalReader, KmsgReader, StreamReader

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


def test_a_real_h200_boot_has_no_gpu_events() -> None:
    """The driver's own start-up lines from the recorded H200 (tests/fixtures/nvml-real-h200/): the
    module load, an FBHUB interrupt the driver clears itself, the persistence-mode notice. NVRM
    lines, none of them a fault."""
    lines = (FIXTURES / "vigil-h200-dmesg-nvrm-boot.log").read_text().splitlines()
    assert sum("NVRM:" in line for line in lines) == 3
    assert fixture_events("vigil-h200-dmesg-nvrm-boot.log") == []


# -- readers ---------------------------------------------------------------------------------


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


# -- one event per fault: companion and detail lines fold into their fault ---------------------


def parsed_lines(lines: Sequence[str]) -> list[ParsedLine]:
    parser = KernelLogParser()
    return [parser.feed(line) for line in lines]


def test_fallen_off_notice_after_its_xid79_is_the_same_fault() -> None:
    # Real journal lines (tests/fixtures/kernel-log/PROVENANCE.md): Xid 79, then the newer
    # drivers' one-line notice for the same GPU, then an unrelated Xid 44.
    lines = (FIXTURES / "blog-xid79-fallen-notice-syslog.log").read_text().splitlines()
    parsed = parsed_lines(lines)
    assert [(p.event.kind, p.event.code) for p in parsed if p.event] == [("xid", 79), ("xid", 44)]
    assert [p.folded for p in parsed] == [None, "xid", None, None, None, None]


def test_fallen_off_notice_alone_or_for_another_gpu_is_its_own_fault() -> None:
    lines = ["[ 10.000000] NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus.",
             "[ 10.000100] NVRM: GPU 0000:5e:00.0: GPU has fallen off the bus.",  # another GPU
             "[ 50.000000] NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus."]  # 40 s later
    events, _ = events_of(lines)
    assert [(e.kind, e.pci_bus_id) for e in events] == [
        ("xid", "0000:3b:00"), ("gpu_lost", "0000:5e:00"), ("gpu_lost", "0000:3b:00")]


def test_repeated_fallen_off_notice_is_one_fault() -> None:
    # Bumblebee-Project/Bumblebee issue 554: the old driver printed the notice twice in 11 us.
    lines = ["[   49.261458] NVRM: GPU at 0000:01:00.0 has fallen off the bus.",
             "[   49.261465] NVRM: os_pci_init_handle: invalid context!",
             "[   49.261472] NVRM: GPU at 0000:01:00.0 has fallen off the bus."]
    parsed = parsed_lines(lines)
    assert [p.event.kind for p in parsed if p.event] == ["gpu_lost"]
    assert parsed[2].folded == "gpu_lost"


def test_sxid_detail_lines_belong_to_their_headline() -> None:
    # NVIDIA/nvtrust issue 124: each "Non-fatal, Link N" headline is followed by its "Severity ...
    # Engine instance N" and "Data {...}" lines; the first Data line's headline is not in the log.
    events = fixture_events("nvtrust-124-sxid-details.log")
    assert [(e.code, e.severity, e.text.split(" Minion")[0]) for e in events] == [
        (22013, None, events[0].text), (22013, "Non-fatal", "Link 44"), (22013, "Non-fatal", "Link 45"),
        (22013, "Non-fatal", "Link 46")]
    assert events[0].text.startswith("Data {0x0000002b")
    folded = [p.folded for p in parsed_lines((FIXTURES / "nvtrust-124-sxid-details.log").read_text().splitlines())]
    assert folded.count("sxid") == 4


def test_sxid_detail_of_another_code_or_switch_is_not_folded() -> None:
    lines = ["[ 1.000] nvidia-nvswitch0: SXid (PCI:0000:c3:00.0): 24007, Fatal, Link 28 sourcetrack timeout error",
             "[ 1.001] nvidia-nvswitch1: SXid (PCI:0000:c4:00.0): 24007, Severity 1 Engine instance 28 "
             "Sub-engine instance 00",
             "[ 1.002] nvidia-nvswitch0: SXid (PCI:0000:c3:00.0): 20009, Data {0x1}",
             "[ 1.003] nvidia-nvswitch0: SXid (PCI:0000:c3:00.0): 24007, Data {0x1c}"]
    parsed = parsed_lines(lines)
    assert [p.folded for p in parsed] == [None, None, None, "sxid"]


def test_mlx5_health_dump_is_one_firmware_event_per_function() -> None:
    # A Linux mailing-list report (PROVENANCE.md): six PCI functions lose health; two dump the
    # health buffer (assert_var[0..5], synd "firmware internal error", ...).
    lines = (FIXTURES / "lkml-mlx5-health-dump.log").read_text().splitlines()
    parsed = parsed_lines(lines)
    events = [p.event for p in parsed if p.event]
    assert [(e.device, e.error) for e in events] == [
        (f"0000:0d:00.{fn}", "health_compromised") for fn in (0, 2, 3, 4, 1, 5)]
    # Per dump: "Health issue observed", six assert_var lines and the synd line read as errors.
    assert [p.folded for p in parsed].count("mlx5_error") == 2 * 8


def test_mlx5_dump_without_a_health_line_opens_its_own_event() -> None:
    # LKML (Niklas Schnelle, mlx5 drain wq): "Fatal error 1 detected" then the register dump.
    lines = ["[   36.447442] mlx5_core 0000:00:00.0: poll_health:694:(pid 0): Fatal error 1 detected",
             "[   36.447450] mlx5_core 0000:00:00.0: print_health_info:372:(pid 0): assert_var[0] 0xffffffff",
             "[   36.447453] mlx5_core 0000:00:00.0: print_health_info:372:(pid 0): assert_var[1] 0xffffffff",
             "[   36.447471] mlx5_core 0000:00:00.0: print_health_info:380:(pid 0): fw_ver 65535.65535.65535"]
    events, _ = events_of(lines)
    assert [(e.device, e.error) for e in events] == [("0000:00:00.0", "firmware_fatal")]


def test_lines_without_timestamps_fold_by_distance() -> None:
    near = ["NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.",
            "NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus."]
    far = [near[0], *(["some other line"] * (FOLD_SPAN_LINES + 1)), near[1]]
    assert [e.kind for e in events_of(near)[0]] == ["xid"]
    assert [e.kind for e in events_of(far)[0]] == ["xid", "gpu_lost"]


@pytest.mark.parametrize(("ts_text", "seconds"), [
    ("1234.567890", 1234.56789),
    ("2025-01-21T04:41:44,283302+00:00", 1737434504.283302),
    ("2024-01-01T03:04:05+0000", 1704078245.0),
    ("2024-01-01T03:04:05Z", 1704078245.0),
    ("Sun Feb 23 16:24:18 2025", 1740327858.0),
])
def test_timestamp_seconds(ts_text: str, seconds: float) -> None:
    assert timestamp_seconds(ts_text) == pytest.approx(seconds)


def test_timestamp_seconds_of_syslog_and_garbage() -> None:
    a, b = timestamp_seconds("Nov 07 18:17:15"), timestamp_seconds("Nov 07 18:17:16")
    assert a is not None and b is not None and b - a == 1.0
    assert timestamp_seconds("") is None and timestamp_seconds("Feb 30 99:99:99") is None


# -- logs collected from many hosts (pdsh/clush "<host>: " prefix) -------------------------------


@pytest.mark.parametrize("line", [
    "gpu-017: [ 1234.567890] mlx5_core 0000:d2:00.0: poll_health:825: device's health compromised - reached "
    "miss count.",
    "gpu-017: mlx5_core 0000:d2:00.0: poll_health:825: device's health compromised - reached miss count.",
    "gpu-017.cluster.local: [Sun Feb 23 16:24:18 2025] mlx5_core 0000:d2:00.0: poll_health:825: device's health "
    "compromised - reached miss count.",
    "gpu-017: Aug 17 06:18:01 gpu-017 kernel: mlx5_core 0000:d2:00.0: poll_health:825: device's health compromised",
    "gpu-017: kern  :err   : 2025-01-21T04:41:44,283302+00:00 mlx5_core 0000:d2:00.0: device's health compromised",
    "gpu-017: 6,1234,5678901,-;mlx5_core 0000:d2:00.0: poll_health:825: device's health compromised",
])
def test_host_prefixed_mlx5_lines_are_parsed_with_their_host(line: str) -> None:
    events, unparsed = events_of([line])
    assert unparsed == [] and len(events) == 1
    assert (events[0].host or "").split(".")[0] == "gpu-017"
    assert (events[0].device, events[0].error) == ("0000:d2:00.0", "health_compromised")


def test_host_prefix_keeps_the_timestamp_and_is_never_a_driver_tag() -> None:
    ts, msg, seq, host = split_line("gpu-017: [ 1234.567890] NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off.")
    assert (ts, host, seq) == ("1234.567890", "gpu-017", None) and msg.startswith("NVRM: Xid")
    for own in ("NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.",
                "nvidia-nvswitch0: SXid (PCI:0004:00:00.0): 26008, SOE Watchdog error",
                "kernel: [16450076.435595] NVRM: Xid (PCI:0002:00:00): 119, pid=1, x"):
        assert split_line(own).host is None


def test_interleaved_hosts_fold_separately() -> None:
    # Two hosts' three-line notices interleaved line by line, as pdsh prints them.
    a = ["[ 1843.308145] NVRM: The NVIDIA GPU 0000:b3:00.0",
         "               NVRM: (PCI ID: 10de:26b5) installed in this system has",
         "               NVRM: fallen off the bus and is not responding to commands."]
    b = ["[ 1843.308145] NVRM: The NVIDIA GPU 0000:18:00.0", *a[1:]]
    lines = [f"{host}: {line}" for pair in zip(a, b, strict=True)
             for host, line in zip(("n1", "n2"), pair, strict=True)]
    events, _ = events_of(lines)
    assert [(e.host, e.kind, e.pci_bus_id) for e in events] == [
        ("n1", "gpu_lost", "0000:b3:00"), ("n2", "gpu_lost", "0000:18:00")]


def test_parser_state_is_bounded_in_hosts() -> None:
    # A host's open fault is forgotten once MAX_HOSTS other hosts were seen after it.
    parser = KernelLogParser()
    xid79 = "[ 1.0] NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus."
    notice = "[ 1.0] NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus."
    parser.feed(f"h0: {xid79}")
    parser.feed(f"h1: {xid79}")
    for n in range(2, MAX_HOSTS + 1):
        parser.feed(f"h{n}: [ 1.0] unrelated")
    parser.feed("h1: [ 1.0] unrelated")  # h1 seen again: kept
    for n in range(MAX_HOSTS + 1, MAX_HOSTS + 3):
        parser.feed(f"h{n}: [ 1.0] unrelated")
    assert parser.feed(f"h1: {notice}").folded == "xid"
    lost = parser.feed(f"h0: {notice}")
    assert lost.folded is None and lost.event is not None and lost.event.kind == "gpu_lost"


def test_a_fault_repeated_every_second_is_counted_every_time() -> None:
    # The fold window is anchored at the fault's first line: a device that keeps failing its
    # health poll is one fault per poll, not one fault forever; details after 2 s are new faults.
    health = "[ {t}.000000] mlx5_core 0000:d2:00.0: poll_health:825: device's health compromised - reached miss count."
    events, _ = events_of([health.format(t=t) for t in range(100, 106)])
    assert len(events) == 6
    late = ["[ 1.000] nvidia-nvswitch0: SXid (PCI:0000:c3:00.0): 24007, Fatal, Link 28 sourcetrack timeout error",
            "[ 3.500] nvidia-nvswitch0: SXid (PCI:0000:c3:00.0): 24007, Data {0x1c}"]
    assert [p.folded for p in parsed_lines(late)] == [None, None]

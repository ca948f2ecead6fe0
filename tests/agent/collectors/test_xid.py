"""The xid collector: counters, GPU identity mapping, flood dedup, resume after restart."""

from __future__ import annotations

import io
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from vigil.agent.collectors import REGISTRY
from vigil.agent.collectors.collector import Collection
from vigil.agent.collectors.xid import PAGED_XID_CODES, XidCollector, XidConfig, open_kernel_log
from vigil.agent.config import parse_config
from vigil.agent.file_follower import FileFollower
from vigil.agent.kernel_log_readers import KmsgReader, LineSource, StreamReader
from vigil.agent.metric import Sample
from vigil.contract.seams import Seams

FIXTURES = Path(__file__).parent.parent.parent / "fixtures" / "kernel-log"
XID79 = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus."
XID95 = "NVRM: Xid (PCI:0000:5d:00): 95, pid='<unknown>', name=<unknown>, Uncontained: FBHUB. RST: Yes, D-RST: No"


@dataclass(frozen=True)
class FakeIdentity:
    index: int
    uuid: str
    pci_bus_id: str


class FakeGpus:
    """An NVML identity table in NVML's own bus id form (8-digit domain, upper case, function)."""

    def __init__(self, rows: list[FakeIdentity], fail: set[int] | None = None) -> None:
        self.rows = rows
        self.fail = fail or set()
        self.reads = 0

    def device_count(self) -> int:
        self.reads += 1
        return len(self.rows)

    def identity(self, index: int) -> FakeIdentity:
        if index in self.fail:
            raise RuntimeError("NVML_ERROR_GPU_IS_LOST")
        return self.rows[index]


GPUS = [
    FakeIdentity(0, "GPU-aaaa", "00000000:3B:00.0"),
    FakeIdentity(1, "GPU-bbbb", "00000000:5D:00.0"),
    FakeIdentity(4, "GPU-509665ad-b600-ac93-3616-d754b23d636d", "00000000:9B:00.0"),
]


class ListSource:
    """A LineSource fed by the test: each cycle returns what was pushed since the last."""

    def __init__(self, *, raw_kmsg: bool = False) -> None:
        self.raw_kmsg = raw_kmsg
        self.lines: list[str] = []
        self.closed = False

    def push(self, *lines: str) -> None:
        self.lines.extend(lines)

    def read_lines(self, max_lines: int) -> list[str]:
        out, self.lines = self.lines[:max_lines], self.lines[max_lines:]
        return out

    def cursor(self) -> dict[str, object]:
        return {}

    def close(self) -> None:
        self.closed = True


def collector(source: LineSource, *, nvml: FakeGpus | None = None, state_dir: Path | None = None,
              boot_id: Path | None = None, **config: object) -> XidCollector:
    return XidCollector(XidConfig.model_validate(config), open_source=lambda: source, nvml=nvml,
                        state_dir=state_dir, boot_id_path=boot_id or Path("/nonexistent/boot_id"))


def value(col: Collection, name: str, **labels: str) -> float | None:
    for s in col.samples:
        if s.name == name and all(s.label(k) == v for k, v in labels.items()):
            return s.value
    return None


def series(col: Collection, name: str) -> list[Sample]:
    return [s for s in col.samples if s.name == name]


def test_xid_counter_carries_gpu_index_and_uuid_from_nvml() -> None:
    src = ListSource()
    c = collector(src, nvml=FakeGpus(GPUS))
    src.push(f"[ 1.0] {XID79}", "[ 2.0] unrelated", f"[ 3.0] {XID95}")
    col = c.collect(100.0)
    assert value(col, "vigil_gpu_xid_errors_total", gpu="0", uuid="GPU-aaaa", code="79") == 1
    assert value(col, "vigil_gpu_xid_errors_total", gpu="1", uuid="GPU-bbbb", code="95") == 1
    assert value(col, "vigil_gpu_xid_last_timestamp_seconds", gpu="0", uuid="GPU-aaaa") == 100.0
    assert value(col, "vigil_kernel_log_lines_read_total") == 3
    by_code = {e.code: e for e in col.events}
    xid79 = by_code[79]
    assert {k: getattr(xid79, k) for k in ("kind", "gpu", "uuid", "pci_bus_id", "urgent", "source", "count")} == {
        "kind": "xid", "gpu": 0, "uuid": "GPU-aaaa", "pci_bus_id": "0000:3b:00", "urgent": True, "source": "kmsg",
        "count": 1,
    }
    assert by_code[95].message == "Uncontained: FBHUB. RST: Yes, D-RST: No"


def test_without_nvml_the_bus_id_still_identifies_the_gpu() -> None:
    src = ListSource()
    c = collector(src, nvml=None)
    src.push(XID79)
    col = c.collect(5.0)
    assert value(col, "vigil_gpu_xid_errors_total", gpu="", uuid="", code="79") == 1
    (ev,) = col.events
    assert (ev.gpu, ev.uuid, ev.pci_bus_id) == (None, None, "0000:3b:00")


def test_one_unreadable_gpu_does_not_hide_the_others() -> None:
    src = ListSource()
    c = collector(src, nvml=FakeGpus(GPUS, fail={0}))
    src.push(XID79, XID95)
    col = c.collect(5.0)
    assert value(col, "vigil_gpu_xid_errors_total", gpu="", uuid="", code="79") == 1
    assert value(col, "vigil_gpu_xid_errors_total", gpu="1", uuid="GPU-bbbb", code="95") == 1


def test_no_lines_means_no_error_series_and_the_paged_codes_at_zero() -> None:
    col = collector(ListSource()).collect(1.0)
    xids = series(col, "vigil_gpu_xid_errors_total")
    assert {(s.label("gpu"), s.label("code"), s.value) for s in xids} == {
        ("", str(code), 0.0) for code in PAGED_XID_CODES}
    assert series(col, "vigil_kernel_log_lines_unparsed_total") == []
    assert value(col, "vigil_kernel_log_lines_read_total") == 0
    assert col.events == []


def test_nvsentinel_fixture_through_the_collector() -> None:
    src = ListSource()
    c = collector(src, nvml=FakeGpus(GPUS))
    src.push(*(FIXTURES / "nvsentinel-kernel-log-samples.txt").read_text().splitlines())
    col = c.collect(10.0)
    xid_total = sum(s.value for s in series(col, "vigil_gpu_xid_errors_total"))
    assert xid_total == 9
    assert value(col, "vigil_nvswitch_sxid_errors_total", switch="nvidia-nvswitch3", pci_bus_id="0000:c1:00",
                 code="28006") == 1
    assert sum(s.value for s in series(col, "vigil_nvswitch_sxid_errors_total")) == 4
    assert value(col, "vigil_mlx5_errors_total", device="0000:d2:00.0", error="health_compromised") == 1
    assert sum(s.value for s in series(col, "vigil_mlx5_errors_total")) == 5
    assert value(col, "vigil_gpu_fallen_off_bus_total", gpu="", uuid="") == 1
    kinds = sorted(e.kind for e in col.events)
    # 13 twice on the same GPU within one cycle is one forwarded event with count 2
    assert kinds == ["gpu_lost"] + ["mlx5_error"] * 5 + ["sxid"] * 4 + ["xid"] * 8
    xid13 = next(e for e in col.events if e.code == 13)
    assert (xid13.count, xid13.pci_bus_id) == (2, "0000:b5:00")
    assert all(e.urgent for e in col.events)
    fatal = next(e for e in col.events if e.code == 24007)
    assert fatal.message.startswith("Fatal, Link 28")


def test_gpud_xid119_fixture_maps_to_gpu4() -> None:
    src = ListSource()
    c = collector(src, nvml=FakeGpus(GPUS))
    src.push(*(FIXTURES / "gpud-dmesg-T-xid119.log").read_text().splitlines())
    col = c.collect(10.0)
    assert value(col, "vigil_gpu_xid_errors_total", gpu="4", uuid="GPU-509665ad-b600-ac93-3616-d754b23d636d",
                 code="119") == 5
    (ev,) = col.events
    assert (ev.gpu, ev.code, ev.count) == (4, 119, 5)


def test_flood_is_counted_in_full_but_forwarded_collapsed_and_rate_limited() -> None:
    src = ListSource()
    c = collector(src, nvml=FakeGpus(GPUS), forward_interval_seconds=10.0, max_lines_per_cycle=200_000)
    # 29 distinct GPU/code keys as on the real node, 100k lines in all (the real one had 800k)
    buses = [f"0000:{b:02x}:00" for b in range(0x10, 0x10 + 29)]
    line = "NVRM: Xid (PCI:{}): 95, pid='<unknown>', name=<unknown>, Uncontained"
    flood = [line.format(buses[i % 29]) for i in range(100_000)]
    src.push(*flood)
    first = c.collect(100.0)
    assert sum(s.value for s in series(first, "vigil_gpu_xid_errors_total")) == 100_000
    assert len(first.events) == 29
    assert sum(e.count for e in first.events) == 100_000
    src.push(*flood[:290])
    second = c.collect(101.0)  # within the forward interval: counted, not forwarded
    assert sum(s.value for s in series(second, "vigil_gpu_xid_errors_total")) == 100_290
    assert second.events == []
    third = c.collect(110.0)  # interval passed: the folded occurrences go out, nothing lost
    assert len(third.events) == 29
    assert {e.count for e in third.events} == {10}
    assert all(e.ts == 101.0 and e.last_ts == 101.0 for e in third.events)
    assert value(third, "vigil_kernel_log_events_forwarded_total", kind="xid") == 58


def test_a_cycle_parses_at_most_max_lines_and_keeps_the_rest() -> None:
    src = ListSource()
    c = collector(src, max_lines_per_cycle=3)
    src.push(*[XID79] * 5)
    assert value(c.collect(1.0), "vigil_gpu_xid_errors_total", code="79") == 3
    assert value(c.collect(2.0), "vigil_gpu_xid_errors_total", code="79") == 5


def test_unparsable_lines_are_counted_by_reason() -> None:
    src = ListSource(raw_kmsg=True)
    c = collector(src)
    src.push("garbage", "6,5,100,-;NVRM: Xid (PCI:0000:3b:00): bogus", f"6,6,101,-;{XID79}")
    col = c.collect(1.0)
    assert value(col, "vigil_kernel_log_lines_unparsed_total", reason="malformed_kmsg_record") == 1
    assert value(col, "vigil_kernel_log_lines_unparsed_total", reason="malformed_xid") == 1
    assert value(col, "vigil_gpu_xid_errors_total", code="79") == 1


def test_appending_to_a_followed_file_moves_the_counter_within_one_cycle(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text(f"[ 1.0] {XID79}\n")  # history before the agent started: not counted
    c = collector(FileFollower(log, start="end"), nvml=FakeGpus(GPUS))
    assert [s for s in series(c.collect(1.0), "vigil_gpu_xid_errors_total") if s.value] == []
    with log.open("a") as fh:
        fh.write(f"[ 2.0] {XID79}\n")
    col = c.collect(1.5)
    assert value(col, "vigil_gpu_xid_errors_total", gpu="0", uuid="GPU-aaaa", code="79") == 1
    (ev,) = col.events
    assert ev.urgent and ev.code == 79
    assert XidConfig().interval_seconds <= 0.5
    c.close()


def test_followed_file_resumes_after_restart_without_recounting(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    state = tmp_path / "state"
    log.write_text("")
    cfg = XidConfig(source="file", path=str(log))

    def start() -> XidCollector:
        holder: list[XidCollector] = []
        col = XidCollector(cfg, open_source=lambda: open_kernel_log(cfg, None, file_cursor=holder[0].saved_cursor()),
                           state_dir=state, boot_id_path=tmp_path / "none")
        holder.append(col)
        return col

    first = start()
    first.collect(1.0)
    log.write_text(f"{XID79}\n{XID79}\n")
    assert value(first.collect(2.0), "vigil_gpu_xid_errors_total", code="79") == 2
    first.close()
    with log.open("a") as fh:
        fh.write(f"{XID95}\n")  # written while the agent was down
    second = start()
    col = second.collect(3.0)
    assert value(col, "vigil_gpu_xid_errors_total", code="79") == 0  # not recounted: the paged code is back at 0
    assert value(col, "vigil_gpu_xid_errors_total", code="95") == 1
    second.close()


def test_kmsg_resumes_by_sequence_on_the_same_boot_only(tmp_path: Path) -> None:
    boot_id = tmp_path / "boot_id"
    boot_id.write_text("boot-1\n")
    state = tmp_path / "state"
    ring = [f"3,{seq},{seq * 1000},-;{XID79}" for seq in range(10, 13)]

    first_src = ListSource(raw_kmsg=True)
    first = collector(first_src, state_dir=state, boot_id=boot_id)
    first_src.push(*ring)
    assert value(first.collect(1.0), "vigil_gpu_xid_errors_total", code="79") == 3
    first.close()

    # restart on the same boot: /dev/kmsg replays the ring buffer plus one new record
    again_src = ListSource(raw_kmsg=True)
    again = collector(again_src, state_dir=state, boot_id=boot_id)
    again_src.push(*ring, f"3,13,13000,-;{XID95}")
    col = again.collect(2.0)
    assert value(col, "vigil_gpu_xid_errors_total", code="79") == 0  # not recounted
    assert value(col, "vigil_gpu_xid_errors_total", code="95") == 1
    assert [e.code for e in col.events] == [95]
    again.close()

    # after a reboot the sequence restarts: the saved one must not hide new records
    boot_id.write_text("boot-2\n")
    rebooted_src = ListSource(raw_kmsg=True)
    rebooted = collector(rebooted_src, state_dir=state, boot_id=boot_id)
    rebooted_src.push(f"3,1,1000,-;{XID79}")
    assert value(rebooted.collect(3.0), "vigil_gpu_xid_errors_total", code="79") == 1


def test_corrupt_state_file_is_counted_and_ignored(tmp_path: Path) -> None:
    (tmp_path / "xid_cursor.json").write_text("{not json")
    src = ListSource()
    c = collector(src, state_dir=tmp_path)
    src.push(XID79)
    col = c.collect(1.0)
    assert value(col, "vigil_kernel_log_read_errors_total", reason="bad_state_file") == 1
    assert value(col, "vigil_gpu_xid_errors_total", code="79") == 1


def test_unopenable_source_fails_the_cycle_and_is_retried(tmp_path: Path) -> None:
    log = tmp_path / "later.log"
    cfg = XidConfig(source="file", path=str(log), file_start="beginning")
    c = XidCollector(cfg, open_source=lambda: open_kernel_log(cfg, None))
    with pytest.raises(OSError):
        c.collect(1.0)
    log.write_text(f"{XID79}\n")
    assert value(c.collect(2.0), "vigil_gpu_xid_errors_total", code="79") == 1
    c.close()


def test_seams_kmsg_overrides_config_and_picks_the_reader(tmp_path: Path) -> None:
    cfg = XidConfig(source="journal")
    log = tmp_path / "drill.log"
    log.write_text("")
    follower = open_kernel_log(cfg, log)
    assert isinstance(follower, FileFollower)
    follower.close()
    stream = open_kernel_log(cfg, io.StringIO(""))
    assert isinstance(stream, StreamReader)
    stream.close()
    kmsg = open_kernel_log(XidConfig(), None)
    assert isinstance(kmsg, KmsgReader) and kmsg.path == Path("/dev/kmsg")


def test_registry_builds_from_agent_config_with_an_injected_file(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text("")
    config = parse_config({"collectors": {"xid": {"interval_seconds": 0.25, "forward_interval_seconds": 5}}})
    c = REGISTRY["xid"](config, Seams(kmsg=str(log), nvml=FakeGpus(GPUS), state_dir=tmp_path / "state"))
    assert c.name == "xid"
    c.collect(1.0)
    with log.open("a") as fh:
        fh.write(f"{XID95}\n")
    col = c.collect(1.25)
    assert value(col, "vigil_gpu_xid_errors_total", gpu="1", uuid="GPU-bbbb", code="95") == 1
    c.close()
    assert (tmp_path / "state" / "xid_cursor.json").exists()


def test_config_rejects_unknown_keys() -> None:
    from vigil.contract.validation import ConfigError

    with pytest.raises(ConfigError, match=r"collectors\.xid\.sourc"):
        parse_config({"collectors": {"xid": {"sourc": "file"}}})


def test_a_file_that_appears_after_start_is_read_from_its_beginning(tmp_path: Path) -> None:
    log = tmp_path / "drill.log"
    c = collector(FileFollower(log, start="end"))
    with pytest.raises(OSError):
        c.collect(1.0)
    log.write_text(f"{XID79}\n")
    assert value(c.collect(2.0), "vigil_gpu_xid_errors_total", code="79") == 1
    c.close()


class _ExitedJournal:
    """A journalctl that printed one line and exited."""

    def __init__(self) -> None:
        self.stdout = io.StringIO(f"2024-01-01T03:04:05+0000 node kernel: {XID79}\n")
        self.pid = 77

    def terminate(self) -> None:
        pass

    def wait(self, timeout: float | None = None) -> int:
        return 0

    def kill(self) -> None:
        pass


def test_a_dead_journalctl_fails_the_cycle_and_is_restarted() -> None:
    spawned: list[_ExitedJournal] = []

    def spawn(argv: object) -> _ExitedJournal:
        spawned.append(_ExitedJournal())
        return spawned[-1]

    cfg = XidConfig(source="journal")
    c = XidCollector(cfg, open_source=lambda: open_kernel_log(cfg, None, spawn=spawn))
    seen = 0.0
    failures = 0
    for i in range(400):  # the reader thread delivers the line, then the end of the stream
        try:
            seen = value(c.collect(float(i)), "vigil_gpu_xid_errors_total", code="79") or seen
        except OSError:
            failures += 1
            break
        time.sleep(0.005)
    assert seen == 1 and failures == 1
    c.collect(1000.0)  # the next cycle starts a new journalctl
    assert len(spawned) == 2
    c.close()


def test_fallen_off_notice_carried_by_its_xid79_is_one_fault_and_not_counted_as_fallen() -> None:
    # The counter's help: notices *not* carried by an Xid 79. Real lines: PROVENANCE.md.
    src = ListSource()
    c = collector(src, nvml=FakeGpus([FakeIdentity(0, "GPU-cccc", "00000000:01:00.0")]))
    src.push(*(FIXTURES / "blog-xid79-fallen-notice-syslog.log").read_text().splitlines())
    col = c.collect(10.0)
    assert value(col, "vigil_gpu_xid_errors_total", gpu="0", uuid="GPU-cccc", code="79") == 1
    assert [x for x in series(col, "vigil_gpu_fallen_off_bus_total") if x.value] == []
    assert value(col, "vigil_kernel_log_lines_folded_total", kind="xid") == 1
    assert [(e.kind, e.code) for e in col.events] == [("xid", 79), ("xid", 44)]
    # A notice with no Xid 79 before it is a fault of its own, and counted.
    src.push("[ 900.0] NVRM: GPU 0000:01:00.0: GPU has fallen off the bus.")
    col = c.collect(20.0)
    assert value(col, "vigil_gpu_fallen_off_bus_total", gpu="0", uuid="GPU-cccc") == 1


def test_sxid_details_and_mlx5_dump_lines_are_counted_as_folded_not_as_errors() -> None:
    src = ListSource()
    c = collector(src)
    src.push(*(FIXTURES / "nvtrust-124-sxid-details.log").read_text().splitlines(),
             *(FIXTURES / "lkml-mlx5-health-dump.log").read_text().splitlines())
    col = c.collect(10.0)
    assert value(col, "vigil_nvswitch_sxid_errors_total", switch="nvidia-nvswitch3", pci_bus_id="0000:04:00",
                 code="22013") == 4
    assert value(col, "vigil_kernel_log_lines_folded_total", kind="sxid") == 4
    assert value(col, "vigil_mlx5_errors_total", device="0000:0d:00.0", error="health_compromised") == 1
    assert value(col, "vigil_mlx5_errors_total", device="0000:0d:00.0", error="firmware_fatal") is None
    assert value(col, "vigil_kernel_log_lines_folded_total", kind="mlx5_error") == 16


def test_paged_codes_are_the_catalogs_acting_codes() -> None:
    from vigil.aggregator.xid_catalog import XidCatalog

    catalog = XidCatalog.default()
    acting = {"reset_gpu", "reboot_node", "inspect_hardware"}
    assert set(PAGED_XID_CODES) == {c for c in catalog.codes() if catalog.entry(c).action.value in acting}
    assert len(PAGED_XID_CODES) == len(set(PAGED_XID_CODES)) == 32


def test_paged_codes_start_at_zero_per_gpu_so_the_first_xid_is_an_increase() -> None:
    src = ListSource()
    c = collector(src, nvml=FakeGpus(GPUS))
    first = c.collect(1.0)
    zeros = series(first, "vigil_gpu_xid_errors_total")
    assert len(zeros) == len(GPUS) * len(PAGED_XID_CODES)
    assert {s.value for s in zeros} == {0.0}
    assert value(first, "vigil_gpu_xid_errors_total", gpu="4", uuid=GPUS[2].uuid, code="79") == 0
    assert value(first, "vigil_gpu_xid_errors_total", code="13") is None  # not paged: born at its first Xid
    assert [x.value for x in series(first, "vigil_gpu_fallen_off_bus_total")] == [0.0] * len(GPUS)
    assert first.events == []
    src.push(XID79)
    second = c.collect(2.0)
    assert value(second, "vigil_gpu_xid_errors_total", gpu="0", uuid="GPU-aaaa", code="79") == 1
    assert len(series(second, "vigil_gpu_xid_errors_total")) == len(zeros)  # the same series, no new one
    # A restarted agent starts every paged series at 0 again: a reset, not an increase.
    again = collector(ListSource(), nvml=FakeGpus(GPUS)).collect(3.0)
    assert value(again, "vigil_gpu_xid_errors_total", gpu="0", uuid="GPU-aaaa", code="79") == 0

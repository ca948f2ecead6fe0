"""The RDMA collector against the real H100 sysfs snapshot, hand-written RoCE trees and mlx5 ethtool output."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from vigil.agent.collectors import REGISTRY
from vigil.agent.collectors.collector import Collection
from vigil.agent.collectors.rdma import AttributeFiles, RdmaCollector, RdmaConfig
from vigil.agent.collectors.rdma_counters import SPECS, parse_ethtool_stats, parse_rate_bits_per_second, parse_state
from vigil.agent.config import parse_config
from vigil.agent.exporter import SnapshotExporter, render
from vigil.agent.metric import Sample
from vigil.contract.seams import Seams
from vigil.contract.validation import ConfigError
from vigil.contract.wire import PortState, Report, decode_report, encode

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "sysfs"
H100 = FIXTURES / "h100"
ROCE = FIXTURES / "roce"
ETHTOOL_TEXT = (FIXTURES / "ethtool-S-mlx5-ens1f0np0.txt").read_text()

# Raw values of the real snapshot (tests/fixtures/sysfs/h100), as a user would read them with cat.
MLX5_0_XMIT_WORDS = 230442669431839
MLX5_0_RCV_WORDS = 230539874932483


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class FakeRunner:
    """Answers `ethtool -S <netdev>` from a table; an exception in the table is raised."""

    def __init__(self, answers: dict[str, str | BaseException]) -> None:
        self.answers = answers
        self.calls: list[list[str]] = []

    def __call__(self, argv: Sequence[str], timeout_seconds: float) -> str:
        self.calls.append(list(argv))
        assert timeout_seconds > 0
        answer = self.answers[argv[-1]]
        if isinstance(answer, BaseException):
            raise answer
        return answer


OPEN_RIGS: list[Rig] = []


class Rig:
    """A collector over a writable copy of a fixture root, with a clock that moves with `now`."""

    def __init__(self, root: Path, runner: FakeRunner | None = None, **config: object) -> None:
        self.root = root
        self.clock = FakeClock()
        self.runner = runner or FakeRunner({})
        self.collector = RdmaCollector(RdmaConfig.model_validate(config), sysfs_root=root, run=self.runner)
        OPEN_RIGS.append(self)

    def cycle(self, advance: float = 1.0) -> Collection:
        self.clock.t += advance
        return self.collector.collect(self.clock.t)

    def port_file(self, device: str, rel: str) -> Path:
        return self.root / "class" / "infiniband" / device / "ports" / "1" / rel


@pytest.fixture(autouse=True)
def _close_collectors() -> Iterator[None]:
    yield
    while OPEN_RIGS:
        OPEN_RIGS.pop().collector.close()  # the collector keeps sysfs files open between cycles


def copy_root(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / src.name
    shutil.copytree(src, dst)
    for p in dst.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    return dst


@pytest.fixture
def h100(tmp_path: Path) -> Rig:
    return Rig(copy_root(H100, tmp_path))


@pytest.fixture
def roce(tmp_path: Path) -> Rig:
    return Rig(copy_root(ROCE, tmp_path), FakeRunner({"ens1f0np0": ETHTOOL_TEXT, "ens1f1np1": ETHTOOL_TEXT}))


def value(samples: list[Sample], name: str, **labels: str) -> float | None:
    found = [s.value for s in samples if s.name == name and all(s.label(k) == v for k, v in labels.items())]
    assert len(found) <= 1, f"{name}{labels} matched {len(found)} series"
    return found[0] if found else None


def port_state(c: Collection, device: str, port: int = 1) -> PortState:
    (ps,) = [p for p in c.report["ports"] if p.device == device and p.port == port]
    return ps


# -- the real H100 tree ---------------------------------------------------------------------------

def test_real_tree_shows_every_port_state_rate_and_identity(h100: Rig) -> None:
    c = h100.cycle()
    s = c.samples
    assert value(s, "vigil_rdma_port_state", device="mlx5_0", port="1", state="ACTIVE") == 4
    assert value(s, "vigil_rdma_port_physical_state", device="mlx5_0", port="1", physical_state="LinkUp") == 5
    assert value(s, "vigil_rdma_port_rate_bytes_per_second", device="mlx5_0", port="1") == 50e9
    assert value(s, "vigil_rdma_port_rate_bytes_per_second", device="mlx5_bond_0", port="1") == 25e9
    assert value(s, "vigil_rdma_device_info", device="mlx5_bond_0", hca_type="MT41692", fw_ver="32.38.3056",
                 board_id="MT_0000000884") == 1
    assert value(s, "vigil_rdma_port_info", device="mlx5_0", port="1", link_layer="InfiniBand", netdev="") == 1
    assert value(s, "vigil_rdma_port_info", device="mlx5_bond_0", port="1", link_layer="Ethernet", netdev="") == 1
    assert sorted((p.device, p.port, p.state, p.phys_state, p.link_layer) for p in c.report["ports"]) == [
        ("mlx5_0", 1, "ACTIVE", "LinkUp", "InfiniBand"),
        ("mlx5_1", 1, "ACTIVE", "LinkUp", "InfiniBand"),
        ("mlx5_bond_0", 1, "ACTIVE", "LinkUp", "Ethernet"),
    ]
    assert c.events == []  # first observation: nothing to compare with


def test_real_tree_counters_with_data_in_bytes(h100: Rig) -> None:
    c = h100.cycle()
    s = c.samples
    assert value(s, "vigil_rdma_port_data_transmitted_bytes_total", device="mlx5_0", port="1") == \
        MLX5_0_XMIT_WORDS * 4
    assert value(s, "vigil_rdma_port_data_received_bytes_total", device="mlx5_0", port="1") == MLX5_0_RCV_WORDS * 4
    assert value(s, "vigil_rdma_port_receive_errors_total", device="mlx5_0", port="1") == 14
    assert value(s, "vigil_rdma_port_receive_switch_relay_errors_total", device="mlx5_1", port="1") == 2
    assert value(s, "vigil_rdma_port_transmit_wait_total", device="mlx5_0", port="1") == 2489603687
    assert value(s, "vigil_rdma_port_adaptive_retransmissions_total", device="mlx5_0", port="1") == 3
    # hw_counters without a dedicated metric are still exported, by file name; lifespan is a setting
    assert value(s, "vigil_rdma_port_driver_stat_total", device="mlx5_0", port="1",
                 counter="rx_write_requests") == 3809045607
    assert value(s, "vigil_rdma_port_driver_stat_total", device="mlx5_0", port="1", counter="lifespan") is None
    ps = port_state(c, "mlx5_0")
    assert ps.counters["port_xmit_data"] == MLX5_0_XMIT_WORDS * 4
    assert ps.counters["rx_dct_connect"] == 422237
    assert "lifespan" not in ps.counters
    assert ps.rate_bits_per_second == 400e9
    # Real sysfs has no np_ecn_marked_roce_packets on these IB ports: absent, never 0
    assert value(s, "vigil_rdma_port_ecn_marked_packets_total", device="mlx5_0", port="1") is None


def test_real_tree_saturated_counters_are_flagged_not_rated(h100: Rig) -> None:
    c1 = h100.cycle()
    s = c1.samples
    # link_downed is 8 bits wide: 255 means it stopped counting; excessive_buffer_overrun_errors is 4 bits: 15
    assert value(s, "vigil_rdma_port_stat_saturated", device="mlx5_1", port="1", counter="link_downed") == 1
    assert value(s, "vigil_rdma_port_stat_saturated", device="mlx5_0", port="1", counter="link_downed") == 0
    assert value(s, "vigil_rdma_port_stat_saturated", device="mlx5_0", port="1",
                 counter="excessive_buffer_overrun_errors") == 1
    assert value(s, "vigil_rdma_port_link_downed_total", device="mlx5_1", port="1") == 255
    assert port_state(c1, "mlx5_1").flags["link_downed"] == "saturated"

    c2 = h100.cycle(advance=2.0)
    ps1 = port_state(c2, "mlx5_1")
    assert ps1.flags["link_downed"] == "saturated"
    assert "link_downed" not in ps1.deltas
    ps0 = port_state(c2, "mlx5_0")
    # Unchanged and healthy: no delta (only counters that moved are listed), no flag.
    assert "link_downed" not in ps0.deltas
    assert "link_downed" not in ps0.flags
    assert c2.events == []


# -- cycles over a copied tree ----------------------------------------------------------------------

def test_flap_written_between_cycles_gives_flap_event_and_delta(h100: Rig) -> None:
    h100.cycle()
    h100.port_file("mlx5_0", "counters/link_downed").write_text("1\n")
    h100.port_file("mlx5_0", "counters/symbol_error").write_text("37\n")
    c = h100.cycle(advance=2.0)
    flaps = [e for e in c.events if e.kind == "link_flap"]
    assert len(flaps) == 1
    assert (flaps[0].device, flaps[0].port, flaps[0].source, flaps[0].urgent) == ("mlx5_0", 1, "sysfs", False)
    assert "link_downed" in flaps[0].message
    ps = port_state(c, "mlx5_0")
    assert ps.deltas["link_downed"] == 1
    assert ps.deltas["symbol_error"] == 37
    assert value(c.samples, "vigil_rdma_port_link_downed_total", device="mlx5_0", port="1") == 1


def test_port_going_down_is_urgent_and_coming_back_is_link_up(h100: Rig) -> None:
    h100.cycle()
    h100.port_file("mlx5_0", "state").write_text("1: DOWN\n")
    h100.port_file("mlx5_0", "phys_state").write_text("2: Polling\n")
    c = h100.cycle()
    (down,) = c.events
    assert (down.kind, down.urgent, down.device, down.port) == ("link_down", True, "mlx5_0", 1)
    assert "ACTIVE/LinkUp -> DOWN/Polling" in down.message
    assert value(c.samples, "vigil_rdma_port_state", device="mlx5_0", port="1", state="DOWN") == 1
    assert port_state(c, "mlx5_0").state == "DOWN"

    assert h100.cycle().events == []  # still down: nothing new
    h100.port_file("mlx5_0", "state").write_text("4: ACTIVE\n")
    h100.port_file("mlx5_0", "phys_state").write_text("5: LinkUp\n")
    (up,) = h100.cycle().events
    assert (up.kind, up.urgent, up.device) == ("link_up", False, "mlx5_0")


def test_counter_going_backwards_is_flagged_reset_never_negative(h100: Rig) -> None:
    h100.cycle()
    h100.port_file("mlx5_0", "counters/port_rcv_data").write_text("1000\n")  # driver reload
    c = h100.cycle()
    ps = port_state(c, "mlx5_0")
    assert ps.flags["port_rcv_data"] == "reset"
    assert "port_rcv_data" not in ps.deltas
    assert all(d >= 0 for d in ps.deltas.values())
    assert ps.counters["port_rcv_data"] == 4000
    assert value(c.samples, "vigil_rdma_port_stat_resets_total", device="mlx5_0", port="1") == 1
    (ev,) = [e for e in c.events if e.kind == "counter_reset"]
    assert ev.device == "mlx5_0" and "port_rcv_data" in ev.message and not ev.urgent
    # Next cycle counts from the new base again
    h100.port_file("mlx5_0", "counters/port_rcv_data").write_text("1500\n")
    ps = port_state(h100.cycle(advance=0.5), "mlx5_0")
    assert ps.deltas["port_rcv_data"] == 2000
    assert "port_rcv_data" not in ps.flags


def test_truncated_and_garbage_files_are_skipped_and_counted(h100: Rig) -> None:
    h100.port_file("mlx5_0", "counters/symbol_error").write_text("12ab\n")
    h100.port_file("mlx5_0", "counters/port_rcv_errors").write_text("")
    h100.port_file("mlx5_0", "state").write_text("4")  # cut before ": ACTIVE"
    h100.port_file("mlx5_0", "rate").write_text("fast\n")
    vl15 = h100.port_file("mlx5_0", "counters/VL15_dropped")
    vl15.unlink()
    vl15.mkdir()  # a read now fails with EISDIR: unreadable
    c = h100.cycle()
    s = c.samples
    for name in ("vigil_rdma_port_symbol_errors_total", "vigil_rdma_port_receive_errors_total",
                 "vigil_rdma_port_vl15_dropped_total", "vigil_rdma_port_rate_bytes_per_second"):
        assert value(s, name, device="mlx5_0", port="1") is None, name
    assert [x for x in s if x.name == "vigil_rdma_port_state" and x.label("device") == "mlx5_0"] == []
    # the rest of the port, and the other ports, are intact
    assert value(s, "vigil_rdma_port_link_downed_total", device="mlx5_0", port="1") == 0
    assert value(s, "vigil_rdma_port_symbol_errors_total", device="mlx5_1", port="1") == 0
    assert value(s, "vigil_rdma_read_errors_total", device="mlx5_0", reason="malformed") == 3
    assert value(s, "vigil_rdma_read_errors_total", device="mlx5_0", reason="empty") == 1
    assert value(s, "vigil_rdma_read_errors_total", device="mlx5_0", reason="unreadable") == 1
    ps = port_state(c, "mlx5_0")
    assert ps.state is None and "symbol_error" not in ps.counters and ps.phys_state == "LinkUp"
    # the errors are cumulative
    assert value(h100.cycle().samples, "vigil_rdma_read_errors_total", device="mlx5_0", reason="malformed") == 6


def test_no_pma_counter_is_absent_not_an_error(h100: Rig) -> None:
    h100.port_file("mlx5_0", "counters/port_xmit_wait").write_text("N/A (no PMA)\n")
    s = h100.cycle().samples
    assert value(s, "vigil_rdma_port_transmit_wait_total", device="mlx5_0", port="1") is None
    assert [x for x in s if x.name == "vigil_rdma_read_errors_total"] == []


def test_absent_counter_files_give_no_sample(h100: Rig) -> None:
    h100.port_file("mlx5_0", "counters/symbol_error").unlink()
    shutil.rmtree(h100.port_file("mlx5_1", "hw_counters"))
    c = h100.cycle()
    s = c.samples
    assert value(s, "vigil_rdma_port_symbol_errors_total", device="mlx5_0", port="1") is None
    assert "symbol_error" not in port_state(c, "mlx5_0").counters
    assert value(s, "vigil_rdma_port_adaptive_retransmissions_total", device="mlx5_1", port="1") is None
    assert value(s, "vigil_rdma_port_link_downed_total", device="mlx5_1", port="1") == 255
    assert [x for x in s if x.name == "vigil_rdma_read_errors_total"] == []


def test_file_vanishing_between_cycles_is_absent_and_rescanned(tmp_path: Path) -> None:
    # Read by path: an unlinked regular file is gone at once. (A kept-open sysfs attribute answers
    # ENODEV when its device goes away, which takes the same path; a regular file cannot.)
    rig = Rig(copy_root(H100, tmp_path), keep_files_open=False)
    rig.cycle()
    rig.port_file("mlx5_0", "counters/symbol_error").unlink()
    s = rig.cycle().samples
    assert value(s, "vigil_rdma_port_symbol_errors_total", device="mlx5_0", port="1") is None
    assert value(s, "vigil_rdma_port_link_downed_total", device="mlx5_0", port="1") == 0
    assert [x for x in s if x.name == "vigil_rdma_read_errors_total"] == []


def test_kept_open_files_see_new_values_and_drop_after_the_rescan(tmp_path: Path) -> None:
    rig = Rig(copy_root(H100, tmp_path), rescan_interval_seconds=30)
    rig.cycle()
    rig.port_file("mlx5_0", "counters/symbol_error").write_text("5\n")
    s = rig.cycle().samples
    assert value(s, "vigil_rdma_port_symbol_errors_total", device="mlx5_0", port="1") == 5
    rig.port_file("mlx5_0", "counters/symbol_error").unlink()
    s = rig.cycle(advance=30).samples
    assert value(s, "vigil_rdma_port_symbol_errors_total", device="mlx5_0", port="1") is None


class SharedFiles(AttributeFiles):
    """One descriptor per path for every collector that opens it, closed only by ``close_all``
    (what the simulator's nodes on one read-only tree share), counting the opens it made."""

    def __init__(self) -> None:
        self.fds: dict[str, int] = {}

    def open(self, path: str) -> int:
        if path not in self.fds:
            self.fds[path] = super().open(path)
        return self.fds[path]

    def close(self, fd: int) -> None:
        assert fd in self.fds.values()

    def close_all(self) -> None:
        for fd in self.fds.values():
            super().close(fd)


@pytest.mark.parametrize("fixture", [H100, ROCE])
def test_collectors_sharing_descriptors_read_what_one_with_its_own_reads(tmp_path: Path, fixture: Path) -> None:
    root = copy_root(fixture, tmp_path)
    runner = FakeRunner({"ens1f0np0": ETHTOOL_TEXT, "ens1f1np1": ETHTOOL_TEXT})
    shared = SharedFiles()
    own = Rig(root, runner)
    sharing = [RdmaCollector(RdmaConfig(), sysfs_root=root, run=runner, files=shared) for _ in range(2)]
    try:
        device = sorted(p.name for p in (root / "class" / "infiniband").iterdir())[0]
        counters = sorted(p.name for p in own.port_file(device, "counters").iterdir()) \
            if own.port_file(device, "counters").is_dir() else []
        for step in range(6):
            if counters:  # counters move between cycles, as on a port carrying traffic
                name = counters[step % len(counters)]
                own.port_file(device, f"counters/{name}").write_text(f"{1000 * step + 7}\n")
            want = own.cycle()
            for collector in sharing:
                got = collector.collect(own.clock.t)
                assert got.samples == want.samples
                assert encode(got.report["ports"]) == encode(want.report["ports"])
                assert got.events == want.events
        opened = len(shared.fds)
        assert opened > 10  # each attribute opened once between the two collectors
        sharing[0].close()  # one node's collector closing leaves the other's reads alone
        assert sharing[1].collect(own.clock.t + 1).samples == own.cycle().samples
        assert len(shared.fds) == opened
    finally:
        for collector in sharing:
            collector.close()
        shared.close_all()


def test_new_counter_file_appears_after_the_rescan_interval(tmp_path: Path) -> None:
    rig = Rig(copy_root(H100, tmp_path), rescan_interval_seconds=30)
    rig.cycle()
    rig.port_file("mlx5_0", "hw_counters/np_cnp_sent").write_text("9\n")
    assert value(rig.cycle(advance=10).samples, "vigil_rdma_port_cnp_sent_total", device="mlx5_0", port="1") is None
    assert value(rig.cycle(advance=25).samples, "vigil_rdma_port_cnp_sent_total", device="mlx5_0", port="1") == 9


def test_vanished_port_is_an_urgent_link_down_and_its_series_go(h100: Rig) -> None:
    h100.cycle()
    shutil.rmtree(h100.root / "class" / "infiniband" / "mlx5_1")
    c = h100.cycle()
    (ev,) = c.events
    assert (ev.kind, ev.urgent, ev.device, ev.port) == ("link_down", True, "mlx5_1", 1)
    assert not [x for x in c.samples if x.label("device") == "mlx5_1"]
    assert sorted(p.device for p in c.report["ports"]) == ["mlx5_0", "mlx5_bond_0"]


def test_node_without_rdma_reports_nothing(tmp_path: Path) -> None:
    c = Rig(tmp_path).cycle()
    assert c.samples == [] and c.events == [] and c.report == {"ports": []}


# -- RoCE -------------------------------------------------------------------------------------------

def test_roce_port_congestion_counters_netdev_and_pfc(roce: Rig) -> None:
    c = roce.cycle()
    s = c.samples
    labels = {"device": "mlx5_2", "port": "1"}
    assert value(s, "vigil_rdma_port_info", **labels, link_layer="Ethernet", netdev="ens1f0np0") == 1
    assert value(s, "vigil_rdma_port_ecn_marked_packets_total", **labels) == 1843021
    assert value(s, "vigil_rdma_port_cnp_sent_total", **labels) == 184467
    assert value(s, "vigil_rdma_port_cnp_handled_total", **labels) == 176230
    assert value(s, "vigil_rdma_port_out_of_sequence_total", **labels) == 325
    assert value(s, "vigil_rdma_port_carrier_changes_total", **labels) == 4
    assert value(s, "vigil_rdma_port_pfc_pause_frames_total", **labels, priority="3", direction="rx") == 98213
    assert value(s, "vigil_rdma_port_pfc_pause_frames_total", **labels, priority="3", direction="tx") == 117
    assert value(s, "vigil_rdma_port_pfc_pause_frames_total", **labels, priority="0", direction="rx") == 0
    assert value(s, "vigil_rdma_port_pfc_pause_duration_seconds_total", **labels, priority="3",
                 direction="rx") == pytest.approx(4.410321)
    # transitions and per-priority bytes are not PFC pause counters
    assert not [x for x in s if x.label("counter") == "rx_prio3_pause_transition"]
    ps = port_state(c, "mlx5_2")
    assert ps.netdev == "ens1f0np0" and ps.counters["rx_prio3_pause"] == 98213
    assert ps.counters["carrier_changes"] == 4
    assert sorted(roce.runner.calls) == [["ethtool", "-S", "ens1f0np0"], ["ethtool", "-S", "ens1f1np1"]]


def test_roce_port_down_without_counters_dir(roce: Rig) -> None:
    c = roce.cycle()
    s = c.samples
    labels = {"device": "mlx5_3", "port": "1"}
    assert value(s, "vigil_rdma_port_state", **labels, state="DOWN") == 1
    assert value(s, "vigil_rdma_port_physical_state", **labels, physical_state="Disabled") == 3
    assert value(s, "vigil_rdma_port_info", **labels, link_layer="Ethernet", netdev="ens1f1np1") == 1
    assert value(s, "vigil_rdma_port_symbol_errors_total", **labels) is None  # no counters/ at all
    assert value(s, "vigil_rdma_port_cnp_sent_total", **labels) == 0
    assert value(s, "vigil_rdma_port_carrier_changes_total", **labels) == 7
    assert c.events == []  # down at first sight is a state, not an event


def test_carrier_changes_moving_on_an_up_roce_port_is_a_flap(roce: Rig) -> None:
    roce.cycle()
    (roce.root / "class" / "net" / "ens1f0np0" / "carrier_changes").write_text("6\n")
    c = roce.cycle()
    (ev,) = c.events
    assert (ev.kind, ev.device, ev.urgent) == ("link_flap", "mlx5_2", False)
    assert port_state(c, "mlx5_2").deltas["carrier_changes"] == 2


def test_ethtool_runs_on_its_own_cadence_and_pfc_deltas_are_between_its_readings(tmp_path: Path) -> None:
    runner = FakeRunner({"ens1f0np0": ETHTOOL_TEXT, "ens1f1np1": ETHTOOL_TEXT})
    rig = Rig(copy_root(ROCE, tmp_path), runner, ethtool_interval_seconds=10)
    rig.cycle()
    c = rig.cycle(advance=1)
    assert len(runner.calls) == 2  # not due yet: last reading re-exported, no delta claimed
    assert value(c.samples, "vigil_rdma_port_pfc_pause_frames_total", device="mlx5_2", port="1", priority="3",
                 direction="rx") == 98213
    assert "rx_prio3_pause" not in port_state(c, "mlx5_2").deltas
    runner.answers["ens1f0np0"] = ETHTOOL_TEXT.replace("rx_prio3_pause: 98213", "rx_prio3_pause: 98313")
    c = rig.cycle(advance=9)
    assert len(runner.calls) == 4
    ps = port_state(c, "mlx5_2")
    assert ps.deltas["rx_prio3_pause"] == 100  # between the two ethtool readings, 10 s apart


@pytest.mark.parametrize("failure, reason", [
    (subprocess.TimeoutExpired(["ethtool"], 2.0), "ethtool_failed"),
    (FileNotFoundError(2, "No such file or directory: 'ethtool'"), "ethtool_failed"),
    (subprocess.CalledProcessError(94, ["ethtool"]), "ethtool_failed"),
    ("Cannot get stats strings information: Operation not supported\n", "ethtool_malformed"),
])
def test_ethtool_failure_is_counted_and_the_port_still_reports(tmp_path: Path, failure: str | BaseException,
                                                               reason: str) -> None:
    rig = Rig(copy_root(ROCE, tmp_path), FakeRunner({"ens1f0np0": failure, "ens1f1np1": ETHTOOL_TEXT}))
    c = rig.cycle()
    s = c.samples
    labels = {"device": "mlx5_2", "port": "1"}
    assert value(s, "vigil_rdma_read_errors_total", device="mlx5_2", reason=reason) == 1
    assert not [x for x in s if x.name.startswith("vigil_rdma_port_pfc") and x.label("device") == "mlx5_2"]
    assert value(s, "vigil_rdma_port_state", **labels, state="ACTIVE") == 4
    assert value(s, "vigil_rdma_port_cnp_sent_total", **labels) == 184467
    assert value(s, "vigil_rdma_port_pfc_pause_frames_total", device="mlx5_3", port="1", priority="3",
                 direction="rx") == 98213


def test_ethtool_can_be_switched_off(tmp_path: Path) -> None:
    rig = Rig(copy_root(ROCE, tmp_path), ethtool=False)
    s = rig.cycle().samples
    assert rig.runner.calls == []
    assert not [x for x in s if x.name.startswith("vigil_rdma_port_pfc")]


# -- parsers, config, registry, exposition ----------------------------------------------------------

def test_parsers() -> None:
    assert parse_state("4: ACTIVE\n") == (4, "ACTIVE")
    assert parse_state("6: LinkErrorRecovery") == (6, "LinkErrorRecovery")
    assert parse_rate_bits_per_second("400 Gb/sec (4X NDR)") == 400e9
    assert parse_rate_bits_per_second("2.5 Gb/sec (1X SDR)\n") == 2.5e9
    for bad in ("ACTIVE", "4", "", "x: y"):
        with pytest.raises(ValueError):
            parse_state(bad)
    with pytest.raises(ValueError):
        parse_rate_bits_per_second("400 Mb/sec")
    stats = parse_ethtool_stats(ETHTOOL_TEXT)
    assert stats["rx_prio3_pause_duration"] == 4410321 and stats["link_down_events_phy"] == 2
    with pytest.raises(ValueError):
        parse_ethtool_stats("rx_prio3_pause: 1\n")


def test_config_rejects_unknown_key_with_its_path() -> None:
    assert parse_config({"collectors": {"rdma": {"ethtool": False}}}).collectors.rdma.ethtool is False
    with pytest.raises(ConfigError, match=r"collectors\.rdma\.ethtool_intervl_seconds: unknown key"):
        parse_config({"collectors": {"rdma": {"ethtool_intervl_seconds": 5}}})


def test_registry_builds_from_seams() -> None:
    clock = FakeClock()
    collector = REGISTRY["rdma"](parse_config({}), Seams(sysfs_root=H100, run=FakeRunner({}), clock=clock))
    try:
        c = collector.collect(clock.t)
    finally:
        collector.close()
    assert collector.name == "rdma"
    assert len(c.report["ports"]) == 3


def test_every_sample_is_declared_with_its_labels_in_order(roce: Rig, h100: Rig) -> None:
    declared = {spec.name: spec for spec in SPECS}
    for rig in (roce, h100):
        rig.cycle()
        for sample in rig.cycle().samples:
            spec = declared[sample.name]
            assert tuple(k for k, _ in sample.labels) == spec.labels, sample


def test_metrics_exposition_of_the_real_tree(h100: Rig) -> None:
    samples = h100.cycle().samples
    text = render(SnapshotExporter(SPECS, [lambda: samples])).decode()
    assert 'vigil_rdma_port_state{device="mlx5_0",port="1",state="ACTIVE"} 4.0' in text
    assert 'vigil_rdma_port_rate_bytes_per_second{device="mlx5_1",port="1"} 5e+10' in text
    assert 'vigil_rdma_port_link_downed_total{device="mlx5_1",port="1"} 255.0' in text
    assert "# TYPE vigil_rdma_port_symbol_errors_total counter" in text


def test_port_states_survive_the_report_wire_round_trip(h100: Rig) -> None:
    h100.cycle()
    h100.port_file("mlx5_0", "counters/port_xmit_data").write_text(f"{MLX5_0_XMIT_WORDS + 250}\n")
    c = h100.cycle(advance=0.5)
    report = Report(node="n1", boot_id="b", seq=1, ts=h100.clock.t, interval_seconds=2.5,
                    ports=c.report["ports"], events=c.events)
    back = decode_report(encode(report))
    ps = next(p for p in back.ports if p.device == "mlx5_0")
    assert ps.deltas["port_xmit_data"] == 1000
    assert next(p for p in back.ports if p.device == "mlx5_1").flags["link_downed"] == "saturated"

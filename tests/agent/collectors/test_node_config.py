"""The node_config collector: NodeConfig and vigil_node_config_info from sysfs (HCAs, OFED), /proc
(kernel), libibverbs' name (rdma-core) and the NVML backend's per-GPU configuration facts (FakeNvml,
its drifted-driver fault); the facts a node's own devices disagree on are named in `mixed`."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from vigil.agent.collectors import REGISTRY
from vigil.agent.collectors.node_config import FACTS, NodeConfigCollector, NodeConfigConfig
from vigil.agent.config import parse_config
from vigil.agent.metric import Sample
from vigil.contract.seams import Seams
from vigil.contract.wire import NodeConfig, check
from vigil.sim import fabric

FIXTURES = Path(__file__).parent.parent.parent / "fixtures" / "sysfs"
KERNEL = "6.8.0-45-generic"


@pytest.fixture
def node(tmp_path: Path) -> dict[str, Path]:
    sysfs = tmp_path / "sys"
    shutil.copytree(FIXTURES / "hgx", sysfs, symlinks=True)
    proc = fabric.build_proc(tmp_path / "proc", KERNEL)
    lib = tmp_path / "lib"
    lib.mkdir()
    # rdma-core 50.0's libibverbs, as its packages install it: the real file and the soname link.
    (lib / "libibverbs.so.1.14.50.0").write_bytes(b"\x7fELF")
    (lib / "libibverbs.so.1").symlink_to("libibverbs.so.1.14.50.0")
    return {"sys": sysfs, "proc": proc, "lib": lib}


def _collector(paths: dict[str, Path], nvml: Any = None) -> NodeConfigCollector:
    config = NodeConfigConfig(library_dirs=[str(paths["lib"].parent / "nowhere"), str(paths["lib"])])
    return NodeConfigCollector(config, nvml=nvml, sysfs_root=paths["sys"], proc_root=paths["proc"])


def _collect(collector: NodeConfigCollector) -> tuple[NodeConfig, list[Sample]]:
    out = collector.collect(0.0)
    config = out.report["config"]
    check(config)
    return config, out.samples


def _errors(samples: list[Sample]) -> dict[tuple[str | None, str | None], float]:
    return {(s.label("source"), s.label("reason")): s.value for s in samples
            if s.name == "vigil_node_config_read_errors_total"}


def test_host_side_facts_of_a_healthy_node(node: dict[str, Path]) -> None:
    config, samples = _collect(_collector(node))
    assert (config.kernel, config.hca_count, config.hca_board_id, config.hca_firmware) == \
        (KERNEL, 2, "MT_0000000838", "28.41.1000")
    assert config.hca_link_rate_bits_per_second == 400e9
    assert (config.ofed_version, config.rdma_core_version) == ("23.10-1.1.9", "50.0")
    assert config.mixed == ()
    # Without NVML: the GPU facts are unknown, not guessed.
    assert (config.driver_version, config.gpu_count, config.gpu_model) == (None, None, None)
    info = [s for s in samples if s.name == "vigil_node_config_info"]
    assert len(info) == 1 and info[0].value == 1
    labels = dict(info[0].labels)
    assert set(labels) == {*FACTS, "mixed"}
    assert (labels["kernel"], labels["hca_firmware"], labels["hca_link_rate_bits_per_second"],
            labels["driver_version"]) == (KERNEL, "28.41.1000", "400000000000", "")
    assert _errors(samples) == {}


def test_one_hca_with_other_firmware_is_named_mixed(node: dict[str, Path]) -> None:
    fabric.NodeFabric(node["sys"]).set_hca_firmware("28.39.1002", hcas=[1])
    config, samples = _collect(_collector(node))
    assert config.hca_firmware == "28.41.1000"  # the first HCA's
    assert config.mixed == ("hca_firmware",)
    assert dict(next(s for s in samples if s.name == "vigil_node_config_info").labels)["mixed"] == "hca_firmware"


def test_real_h100_node_with_a_front_end_nic_is_not_mixed(tmp_path: Path) -> None:
    # The recorded gpud H100 node: two ConnectX-7 NDR ports and a 200G RoCE bond of another board
    # and firmware. That NIC is a second model by design, not drift: the facts are the main model's.
    sysfs = tmp_path / "sys"
    shutil.copytree(FIXTURES / "h100", sysfs)
    paths = {"sys": sysfs, "proc": fabric.build_proc(tmp_path / "proc", KERNEL), "lib": tmp_path}
    config, _ = _collect(_collector(paths))
    assert (config.hca_count, config.hca_board_id, config.hca_firmware, config.hca_link_rate_bits_per_second) == \
        (3, "MT_0000000838", "28.41.1000", 400e9)
    assert config.mixed == ()
    assert config.rdma_core_version is None  # no libibverbs in that directory
    # One of the two compute HCAs on other firmware is mixed; the front-end NIC still is not.
    (sysfs / "class/infiniband/mlx5_1/fw_ver").write_text("28.39.1002")
    assert _collect(_collector(paths))[0].mixed == ("hca_firmware",)


def test_inbox_driver_is_no_ofed(node: dict[str, Path]) -> None:
    fabric.NodeFabric(node["sys"]).set_ofed_version(None)
    assert _collect(_collector(node))[0].ofed_version is None
    # Some distributions' inbox mlx5_core declares the kernel's release as its version: not an OFED.
    fabric.NodeFabric(node["sys"]).set_ofed_version(KERNEL)
    assert _collect(_collector(node))[0].ofed_version is None
    fabric.NodeFabric(node["sys"]).set_ofed_version("24.10-1.1.4")
    assert _collect(_collector(node))[0].ofed_version == "24.10-1.1.4"


def test_unusable_files_are_absent_and_counted(node: dict[str, Path]) -> None:
    ib = node["sys"] / "class/infiniband"
    (ib / "mlx5_0/board_id").write_text("MT_" + "9" * 200 + "\n")  # no board id is that long
    (ib / "mlx5_1/fw_ver").write_text("")
    (ib / "mlx5_1/ports/1/rate").write_text("fast\n")
    (node["proc"] / "sys/kernel/osrelease").write_text("")
    config, samples = _collect(_collector(node))
    assert (config.hca_board_id, config.hca_firmware, config.kernel) == ("MT_0000000838", "28.41.1000", None)
    assert config.hca_link_rate_bits_per_second == 400e9  # mlx5_0's port was fine
    assert config.mixed == ()
    assert _errors(samples) == {("hca", "too_long"): 1, ("hca", "empty"): 1, ("hca", "malformed"): 1,
                                ("kernel", "empty"): 1}


def test_a_node_without_rdma_devices(tmp_path: Path) -> None:
    config, samples = _collect(_collector({"sys": tmp_path / "sys", "proc": tmp_path / "proc", "lib": tmp_path}))
    assert (config.hca_count, config.hca_firmware, config.ofed_version, config.kernel) == (0, None, None, None)
    assert _errors(samples) == {}  # a missing /proc file is absent, not broken


def test_down_ports_give_no_rate(node: dict[str, Path]) -> None:
    nf = fabric.NodeFabric(node["sys"])
    nf.set_link(0, up=False)
    nf.set_link(1, up=False)
    assert _collect(_collector(node))[0].hca_link_rate_bits_per_second is None


def test_the_simulators_tree_drives_each_host_side_fact(tmp_path: Path) -> None:
    root = fabric.build_tree(tmp_path / "sys", 4, gpu_bus_ids=("00000000:19:00.0",), nvswitches=4)
    nf = fabric.NodeFabric(root)
    paths = {"sys": root, "proc": fabric.build_proc(tmp_path / "proc", "5.15.0-119-generic"), "lib": tmp_path}
    collector = _collector(paths)
    healthy, _ = _collect(collector)
    assert (healthy.hca_count, healthy.hca_firmware, healthy.ofed_version, healthy.kernel, healthy.mixed) == \
        (4, fabric.HCA_FIRMWARE, fabric.OFED_VERSION, "5.15.0-119-generic", ())
    nf.set_hca_firmware("28.42.1000")  # every HCA: drifted from the peers, not mixed
    nf.set_ofed_version("24.10-1.1.4")
    fabric.build_proc(paths["proc"], "6.8.0-45-generic")
    drifted, _ = _collect(collector)
    assert (drifted.hca_firmware, drifted.ofed_version, drifted.kernel, drifted.mixed) == \
        ("28.42.1000", "24.10-1.1.4", "6.8.0-45-generic", ())
    nf.reset(4, "InfiniBand")  # a reboot keeps the firmware and the OFED it had
    assert _collect(collector)[0].hca_firmware == "28.42.1000"


def test_built_from_the_registry(node: dict[str, Path]) -> None:
    config = parse_config({"collectors": {"node_config": {"library_dirs": [str(node["lib"])]}}})
    collector = REGISTRY["node_config"](config, Seams(sysfs_root=node["sys"], proc_root=node["proc"]))
    assert collector.collect(0.0).report["config"].rdma_core_version == "50.0"


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


START = 1_700_000_000.0


def _fake_backend(scenario: str, clock: Clock) -> Any:
    from vigil.agent.nvml.backend import PynvmlBackend
    from vigil.agent.nvml.fake import FakeNvml
    from vigil.agent.nvml.scenario import load_node_scenario

    backend = PynvmlBackend(FakeNvml(load_node_scenario(scenario), clock, start=START))
    backend.init()
    return backend


def test_gpu_facts_from_fake_nvml_healthy_h100(node: dict[str, Path]) -> None:
    from vigil.agent.nvml.profiles import PROFILES

    profile = PROFILES["h100-sxm-80gb"]
    config, samples = _collect(_collector(node, _fake_backend("healthy-h100", Clock(START))))
    assert (config.driver_version, config.cuda_driver_version) == (profile.driver_version, "12.2")
    assert (config.gpu_model, config.gpu_count) == (profile.name, 8)
    assert (config.ecc_mode, config.persistence_mode) == ("enabled", "enabled")
    assert config.power_limit_watts == 700.0
    assert config.mixed == ()
    labels = dict(next(s for s in samples if s.name == "vigil_node_config_info").labels)
    assert (labels["driver_version"], labels["gpu_count"], labels["power_limit_watts"]) == \
        (profile.driver_version, "8", "700")
    assert _errors(samples) == {}


def test_drifted_driver_and_one_gpu_capped_by_hand(node: dict[str, Path]) -> None:
    # FakeNvml's config_drift fault (scenarios/node/config-drift-driver.yaml): another driver from
    # boot, every GPU alike (drift from the peers, not mixed); at 120 s GPU 3 capped with ECC off.
    clock = Clock(START + 10)
    collector = _collector(node, _fake_backend("config-drift-driver", clock))
    early, _ = _collect(collector)
    assert (early.driver_version, early.cuda_driver_version, early.mixed) == ("550.90.07", "12.4", ())
    clock.t = START + 130
    late, samples = _collect(collector)
    assert late.driver_version == "550.90.07"
    assert (late.power_limit_watts, late.ecc_mode) == (700.0, "enabled")  # GPU 0's
    assert late.mixed == ("ecc_mode", "power_limit_watts")
    assert dict(next(s for s in samples if s.name == "vigil_node_config_info").labels)["mixed"] == \
        "ecc_mode,power_limit_watts"


def test_a_lost_gpu_leaves_its_facts_unknown_not_mixed(node: dict[str, Path]) -> None:
    clock = Clock(START + 200)
    config, samples = _collect(_collector(node, _fake_backend("gpu-lost", clock)))
    assert config.gpu_count == 8 and config.mixed == ()
    assert config.driver_version is not None
    assert any(source == "nvml" for source, _ in _errors(samples))


def test_config_and_pcie_ride_the_report(node: dict[str, Path]) -> None:
    from vigil.agent.collectors.pcie import PcieCollector, PcieConfig
    from vigil.agent.reporter import build_report
    from vigil.agent.runner import collect_once
    from vigil.agent.snapshot import Snapshot
    from vigil.contract.wire import decode_report, encode

    snapshot = Snapshot()
    for collector in (_collector(node), PcieCollector(PcieConfig(), node["sys"])):
        snapshot.put(collector.name, collect_once(collector, START))
    report = build_report(snapshot, [], node="n1", boot_id="b", seq=1, ts=START, interval_seconds=2.5, topology={})
    back = decode_report(encode(report))
    assert back.config is not None and back.config.kernel == KERNEL
    assert back.pcie is not None and [d.kind for d in back.pcie] == ["hca", "gpu", "gpu", "hca"]

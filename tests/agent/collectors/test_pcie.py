"""The pcie collector over sysfs trees: tests/fixtures/sysfs/hgx (real file formats, PROVENANCE.md),
real single files recorded elsewhere, the simulator's tree, and files broken in each way a read can
break. A file that cannot be used is absent and counted; nothing fails the cycle."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from vigil.agent.collectors import REGISTRY
from vigil.agent.collectors.pcie import PcieCollector, PcieConfig, Unusable, aer_total, link_generation
from vigil.agent.config import parse_config
from vigil.agent.metric import Sample
from vigil.contract.seams import Seams
from vigil.contract.wire import PcieDevice, check
from vigil.sim import fabric

FIXTURES = Path(__file__).parent.parent.parent / "fixtures" / "sysfs"
HGX = FIXTURES / "hgx"
PCI = FIXTURES / "pci"
HCA0, HCA1, GPU0, GPU1 = "0000:18:00.0", "0000:40:00.0", "0000:19:00.0", "0000:3b:00.0"


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "sys"
    shutil.copytree(HGX, root, symlinks=True)
    return root


def _collect(root: Path, now: float = 0.0) -> tuple[dict[str, PcieDevice], list[Sample]]:
    out = PcieCollector(PcieConfig(), root).collect(now)
    return {d.pci_bus_id: d for d in out.report["pcie"]}, out.samples


def _value(samples: list[Sample], name: str, **labels: str) -> float | None:
    for s in samples:
        if s.name == name and all(s.label(k) == v for k, v in labels.items()):
            return s.value
    return None


def _errors(samples: list[Sample]) -> dict[tuple[str | None, str | None], float]:
    return {(s.label("pci_bus_id"), s.label("reason")): s.value for s in samples
            if s.name == "vigil_pcie_read_errors_total"}


def test_healthy_hgx_node_every_hca_and_gpu_once_nvswitch_left_out(tree: Path) -> None:
    devices, samples = _collect(tree)
    assert list(devices) == [HCA0, GPU0, GPU1, HCA1]  # bus order; the NVSwitch (a bridge) is not a GPU
    hca = devices[HCA0]
    assert (hca.kind, hca.name, hca.link_generation, hca.link_generation_max, hca.link_width, hca.link_width_max) \
        == ("hca", "mlx5_0", 5, 5, 16, 16)
    assert (hca.aer_correctable_total, hca.aer_nonfatal_total, hca.aer_fatal_total) == (0, 0, 0)
    gpu = devices[GPU0]
    # A GPU's link is NVML's (GpuState): only its AER counters come from here.
    assert (gpu.kind, gpu.name, gpu.link_generation, gpu.link_width, gpu.aer_fatal_total) \
        == ("gpu", None, None, None, 0)
    for d in devices.values():
        check(d)
    assert _value(samples, "vigil_pcie_link_width", pci_bus_id=HCA1, kind="hca", device="mlx5_1") == 16
    assert _value(samples, "vigil_pcie_link_width", pci_bus_id=GPU0) is None
    # A GPU's `device` label is its bus id as NVML writes it: vigil_gpu_info's pci_bus_id joins it.
    assert _value(samples, "vigil_pcie_aer_errors_total", pci_bus_id=GPU1, device="00000000:3B:00.0",
                  severity="fatal") == 0
    assert _errors(samples) == {}


def test_hca_trained_down_to_x8_the_other_stays_at_x16(tree: Path) -> None:
    (tree / "bus/pci/devices" / HCA1 / "current_link_width").write_text("8\n")
    (tree / "bus/pci/devices" / HCA1 / "current_link_speed").write_text("16.0 GT/s PCIe\n")
    devices, samples = _collect(tree)
    assert (devices[HCA1].link_width, devices[HCA1].link_width_max) == (8, 16)
    assert (devices[HCA1].link_generation, devices[HCA1].link_generation_max) == (4, 5)
    assert (devices[HCA0].link_width, devices[HCA0].link_generation) == (16, 5)
    assert _value(samples, "vigil_pcie_link_width", pci_bus_id=HCA1) == 8
    assert _value(samples, "vigil_pcie_link_width_max", pci_bus_id=HCA1) == 16


def test_gpu_aer_fatal_count_only_on_that_gpu(tree: Path) -> None:
    path = tree / "bus/pci/devices" / GPU1 / "aer_dev_fatal"
    path.write_text(path.read_text().replace("CmpltTO 0", "CmpltTO 3").replace("TOTAL_ERR_FATAL 0",
                                                                                "TOTAL_ERR_FATAL 3"))
    devices, samples = _collect(tree)
    assert devices[GPU1].aer_fatal_total == 3
    assert (devices[GPU1].aer_nonfatal_total, devices[GPU1].aer_correctable_total) == (0, 0)
    assert devices[GPU0].aer_fatal_total == 0
    assert _value(samples, "vigil_pcie_aer_errors_total", pci_bus_id=GPU1, severity="fatal") == 3


def test_truncated_and_garbled_files_are_absent_and_counted_never_fatal(tree: Path) -> None:
    hca = tree / "bus/pci/devices" / HCA0
    aer = (hca / "aer_dev_correctable").read_text()
    (hca / "aer_dev_correctable").write_text(aer[: len(aer) // 2])  # a short read: no TOTAL_ERR_COR line
    (hca / "current_link_speed").write_text("")
    (hca / "max_link_speed").write_text("banana GT/s\n")
    (hca / "current_link_width").write_text("63\n")  # a wedged device's all-ones
    (hca / "max_link_width").write_text("\x00\x01")
    (tree / "bus/pci/devices" / GPU0 / "aer_dev_nonfatal").write_text("TOTAL_ERR_NONFATAL -1\n")
    collector = PcieCollector(PcieConfig(), tree)
    collector.collect(0.0)
    out = collector.collect(10.0)
    devices = {d.pci_bus_id: d for d in out.report["pcie"]}
    d = devices[HCA0]
    assert (d.aer_correctable_total, d.link_generation, d.link_generation_max, d.link_width, d.link_width_max) \
        == (None, None, None, None, None)
    assert (d.aer_nonfatal_total, d.aer_fatal_total) == (0, 0)  # the files that were fine still count
    assert devices[GPU0].aer_nonfatal_total is None
    assert devices[HCA1].link_width == 16
    # Counted per cycle: two cycles, twice each.
    assert _errors(out.samples) == {(HCA0, "malformed"): 6, (HCA0, "empty"): 2, (HCA0, "out_of_range"): 2,
                                    (GPU0, "malformed"): 2}


def test_unknown_speed_is_absent_and_not_an_error(tree: Path) -> None:
    # The kernel's own word for a link it cannot name (a link down): no generation, nothing wrong read.
    (tree / "bus/pci/devices" / HCA0 / "current_link_speed").write_text("Unknown\n")
    devices, samples = _collect(tree)
    assert devices[HCA0].link_generation is None
    assert devices[HCA0].link_generation_max == 5
    assert _errors(samples) == {}


@pytest.mark.parametrize(("text", "generation"), [
    ((PCI / "procfs/0000:a2:00.0/current_link_speed").read_text().strip(), 4),  # real: 16.0 GT/s PCIe
    ((PCI / "procfs/0000:01:00.0/current_link_speed").read_text().strip(), 3),  # real: 8.0 GT/s PCIe
    ("2.5 GT/s PCIe", 1), ("5.0 GT/s PCIe", 2), ("32.0 GT/s PCIe", 5), ("64.0 GT/s PCIe", 6),
    ("8 GT/s", 3), ("5 GT/s", 2),  # kernels before 5.7
    ("Unknown", None), ("Unknown speed", None),
])
def test_link_speed_texts(text: str, generation: int | None) -> None:
    assert link_generation(text) == generation


@pytest.mark.parametrize("text", ["12.0 GT/s PCIe", "32.0 GB/s", "PCIe 5.0", "x16"])
def test_link_speed_lookalikes_are_malformed(text: str) -> None:
    with pytest.raises(Unusable):
        link_generation(text)


def test_real_aer_files_both_naming_styles() -> None:
    # Kernel 6.x short names (prometheus/procfs' recorded device) and the ABI document's sample.
    assert aer_total((PCI / "procfs/0000:a2:00.0/aer_dev_fatal").read_text(), "TOTAL_ERR_FATAL") == 0
    assert aer_total((PCI / "procfs/0000:01:00.0/aer_dev_nonfatal").read_text(), "TOTAL_ERR_NONFATAL") == 0
    assert aer_total((PCI / "kernel-doc/aer_dev_correctable").read_text(), "TOTAL_ERR_COR") == 2


def test_a_tree_copied_without_links_finds_hcas_by_uevent(tmp_path: Path) -> None:
    root = tmp_path / "sys"
    shutil.copytree(HGX, root)  # links followed: class/infiniband/*/device is a plain directory now
    assert not (root / "class/infiniband/mlx5_0/device").is_symlink()
    devices, _ = _collect(root)
    assert devices[HCA0].name == "mlx5_0" and devices[HCA0].link_width == 16


def test_a_device_that_goes_away_is_dropped_without_waiting_for_the_rescan(tree: Path) -> None:
    collector = PcieCollector(PcieConfig(rescan_interval_seconds=3600), tree)
    assert len(collector.collect(0.0).report["pcie"]) == 4
    shutil.rmtree(tree / "bus/pci/devices" / GPU1)
    assert [d.pci_bus_id for d in collector.collect(10.0).report["pcie"]] == [HCA0, GPU0, HCA1]


def test_no_pci_tree_no_devices(tmp_path: Path) -> None:
    devices, samples = _collect(tmp_path)
    assert devices == {} and samples == []


def test_built_from_the_registry_reads_the_seams_sysfs(tree: Path) -> None:
    collector = REGISTRY["pcie"](parse_config({}), Seams(sysfs_root=tree))
    assert len(collector.collect(0.0).report["pcie"]) == 4


def test_the_simulators_tree_drives_a_degraded_link_and_aer_counts(tmp_path: Path) -> None:
    gpus = ("00000000:19:00.0", "00000000:3B:00.0")
    root = fabric.build_tree(tmp_path / "sys", 2, gpu_bus_ids=gpus, nvswitches=4)
    node = fabric.NodeFabric(root, gpu_bus_ids=gpus, nvswitches=4)
    collector = PcieCollector(PcieConfig(), root)
    healthy = collector.collect(0.0).report["pcie"]
    assert [(d.kind, d.link_width, d.aer_fatal_total) for d in healthy] == \
        [("hca", 16, 0), ("hca", 16, 0), ("gpu", None, 0), ("gpu", None, 0)]
    node.set_pcie_link("hca", 1, width=8, generation=3)
    node.add_aer("gpu", 1, "fatal", 2)
    node.add_aer("gpu", 1, "fatal", 1)
    node.add_aer("hca", 0, "correctable", 5)
    devices = {(d.kind, d.name or d.pci_bus_id): d for d in collector.collect(10.0).report["pcie"]}
    hca1 = devices[("hca", fabric.device_name(1))]
    assert (hca1.link_width, hca1.link_width_max, hca1.link_generation, hca1.link_generation_max) == (8, 16, 3, 5)
    assert devices[("gpu", "0000:3b:00.0")].aer_fatal_total == 3
    assert devices[("gpu", "0000:19:00.0")].aer_fatal_total == 0
    assert devices[("hca", fabric.device_name(0))].aer_correctable_total == 5
    node.reset(2, "InfiniBand")  # a reboot retrains the link and clears the counts
    assert [(d.link_width, d.aer_fatal_total, d.aer_correctable_total)
            for d in collector.collect(20.0).report["pcie"]] == [(16, 0, 0), (16, 0, 0), (None, 0, 0), (None, 0, 0)]


def test_sriov_virtual_functions_are_not_reported(tree: Path) -> None:
    # A VF of HCA 0 with its own RDMA device: no link of its own (Unknown, x0): reporting it would
    # read as an HCA trained down to x0.
    vf = tree / "bus/pci/devices/0000:18:00.2"
    shutil.copytree(tree / "bus/pci/devices" / HCA0, vf)
    (vf / "current_link_speed").write_text("Unknown\n")
    (vf / "current_link_width").write_text("0\n")
    (vf / "physfn").symlink_to(Path("..", HCA0))
    (tree / "class/infiniband/mlx5_2").mkdir()
    (tree / "class/infiniband/mlx5_2/device").symlink_to(Path("..", "..", "..", "bus/pci/devices/0000:18:00.2"))
    devices, _ = _collect(tree)
    assert list(devices) == [HCA0, GPU0, GPU1, HCA1]

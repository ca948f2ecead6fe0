"""A whole report's ``pcie`` section equal to the devices held is taken without per-device work
(Fleet._ingest_pcie's short way): over randomized evolving sections it leaves every device, its
counters and the node's PCIe marks exactly as the long way (each entry in turn) does, and a
section with any entry changed is never taken the short way."""

from __future__ import annotations

import random

import pytest

from vigil.aggregator.fleet import Fleet, FleetConfig, NodeState
from vigil.contract.wire import PcieDevice, Report


class LongWayFleet(Fleet):
    """The reference: every section entry by entry, as before the short way."""

    def _ingest_pcie(self, node: NodeState, section: list[PcieDevice], now: float, revision: int,
                     refused: dict[str, int]) -> None:
        self._take_pcie_section(node, section, now, revision, refused)


def _device(rng: random.Random, bus: int) -> dict[str, object]:
    raw = f"0000:{bus:02x}:00.0"
    if rng.random() < 0.1:
        raw = f"0000{raw}".upper()  # NVML's 8-digit domain, upper case: the same device
    return {"pci_bus_id": raw, "kind": rng.choice(("gpu", "hca")), "link_generation": rng.choice((4, 5)),
            "link_generation_max": 5, "link_width": rng.choice((8, 16, 16, 16)), "link_width_max": 16,
            "aer_correctable_total": rng.randint(0, 3), "aer_nonfatal_total": 0}


def _evolve(rng: random.Random, section: list[dict[str, object]]) -> list[dict[str, object]]:
    """The next report's section: usually the same, sometimes one thing about it changed."""
    out = [dict(d) for d in section]
    roll = rng.random()
    if roll < 0.55 or not out:
        return out
    i = rng.randrange(len(out))
    if roll < 0.65:
        out[i]["aer_correctable_total"] = int(out[i]["aer_correctable_total"]) + rng.randint(1, 3)  # type: ignore[call-overload]
    elif roll < 0.7:
        out[i]["aer_correctable_total"] = 0  # a reset
    elif roll < 0.78:
        out[i]["link_width"] = rng.choice((4, 8, 16))
    elif roll < 0.82:
        out[i]["kind"] = "hca" if out[i]["kind"] == "gpu" else "gpu"
    elif roll < 0.87:
        out.pop(i)
    elif roll < 0.92:
        out.append(_device(rng, rng.randrange(0x10, 0x30)))  # new, or a duplicate of one held
    elif roll < 0.96:
        rng.shuffle(out)
    else:
        out[i]["pci_bus_id"] = str(out[i]["pci_bus_id"]).upper()  # the same device, spelled otherwise
    return out


def _reports(seed: int) -> list[Report]:
    rng = random.Random(seed)
    section = [_device(rng, 0x10 + k) for k in range(rng.randint(0, 6))]
    boot, seq, out = "boot-1", 0, []
    for k in range(60):
        section = _evolve(rng, section)
        if rng.random() < 0.05:
            boot, seq = f"boot-{k}", 0  # a reboot forgets the AER baselines: the short way must not stand for them
        seq += 1
        pcie = None if rng.random() < 0.1 else [PcieDevice(**d) for d in section]  # type: ignore[arg-type]
        out.append(Report(node="n1", boot_id=boot, seq=seq, ts=k * 2.5, interval_seconds=2.5, pcie=pcie))
    return out


def _pcie_state(fleet: Fleet, refused: list[dict[str, int]]) -> tuple[object, ...]:
    node = fleet.view().nodes["n1"]
    devices = [(bus_id, h.bus_id, h.last, h.link_below_since, h.counters.last_ts, h.counters.last_increase_ts,
                h.counters.resets, [(name, h.counters.increases_since(name, 0.0), h.counters.covered_seconds(name, 0.0),
                                     h.counters.baseline_since(name)) for name in ("aer_correctable_total",
                                                                                   "aer_nonfatal_total")])
               for bus_id, h in node.pcie.items()]
    return devices, node.pcie_revision, node.pcie_aer_moved_ts, node.pcie_links_below, refused


@pytest.mark.parametrize("seed", range(40))
def test_the_short_way_leaves_what_the_long_way_does(seed: int) -> None:
    config = FleetConfig(max_pcie_devices_per_node=4)  # some sections go over the cap
    fleets = Fleet(config), LongWayFleet(config)
    refused: tuple[list[dict[str, int]], list[dict[str, int]]] = ([], [])
    for report in _reports(seed):
        for fleet, out in zip(fleets, refused, strict=True):
            assert fleet.refusal(report, report.ts) is None
            out.append(fleet.ingest(report, report.ts))
        assert _pcie_state(fleets[0], refused[0]) == _pcie_state(fleets[1], refused[1])


def test_an_unchanged_section_moves_no_marker_and_a_changed_entry_is_taken() -> None:
    devices = [{"pci_bus_id": "0000:18:00.0", "kind": "gpu", "aer_correctable_total": 1},
               {"pci_bus_id": "0000:40:00.0", "kind": "hca", "link_width": 16, "link_width_max": 16}]
    fleet = Fleet()

    def report(seq: int, section: list[dict[str, object]]) -> Report:
        return Report(node="n1", boot_id="b", seq=seq, ts=seq * 2.5, interval_seconds=2.5,
                      pcie=[PcieDevice(**d) for d in section])  # type: ignore[arg-type]

    fleet.ingest(report(1, devices), 2.5)
    node = fleet.view().nodes["n1"]
    marks = node.pcie_revision, node.pcie_aer_moved_ts
    fleet.ingest(report(2, devices), 5.0)  # equal entries, new objects
    assert (node.pcie_revision, node.pcie_aer_moved_ts) == marks
    assert node.pcie["0000:18:00.0"].counters.last_ts == 5.0  # still read at this report
    devices[1] = {**devices[1], "link_width": 8}  # one entry changed: taken
    fleet.ingest(report(3, devices), 7.5)
    assert node.pcie_revision > marks[0] and node.pcie_links_below == {"0000:40:00.0"}
    devices[0] = {**devices[0], "aer_correctable_total": 4}
    fleet.ingest(report(4, devices), 10.0)
    assert node.pcie_aer_moved_ts == 10.0
    assert node.pcie["0000:18:00.0"].counters.sum_since("aer_correctable_total", 0.0) == 3

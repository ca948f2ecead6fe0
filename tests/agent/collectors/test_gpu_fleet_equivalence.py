"""The GPU collector over PynvmlBackend over FakeNvml, on randomized fleets, answers what it answered
before the read path was made cheaper (issue 47, fifth round): every sample, report section and event
of each cycle is digested, and the digests were recorded on the unchanged code (commit 51b9bcc).

Each seed draws a board (H100, H200, A100, V100), a GPU count, a noisy load, a dozen faults of the
kinds the board can show (NVLink errors and links down, throttle windows, ECC, remaps, lost GPUs,
fabric, PCIe link, recovery verdicts, config drift, NVML going away), MIG layouts, and run-time
switches (utilization, busy spin, probe loads, processes, resets) at random cycles on the fast and the
slow (NVLink, energy, fabric) cadence. A change that is meant to alter what the collector says must
regenerate the digests (``python tests/agent/collectors/test_gpu_fleet_equivalence.py``) and say why.
"""

from __future__ import annotations

import hashlib
import random
import sys
from typing import Any

import msgspec
import pytest

from vigil.agent.collectors.gpu import GpuCollector, GpuConfig
from vigil.agent.nvml.backend import PynvmlBackend
from vigil.agent.nvml.fake import FakeNvml
from vigil.agent.nvml.profiles import PROFILES
from vigil.agent.nvml.scenario import NodeScenario, parse_node_scenario


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


_CONDITIONS = ("degraded_bandwidth", "route_recovery", "route_unhealthy", "access_timeout_recovery")
_ACTIONS = ("none", "gpu_reset", "node_reboot", "drain_p2p", "drain_and_reset")


def _fault(rng: random.Random, gpus: int, links: int) -> dict[str, Any]:
    at = rng.choice((0.0, rng.uniform(0, 1800)))
    gpu = rng.randrange(gpus)
    duration = rng.choice((None, rng.uniform(30, 900)))
    kind = rng.choice((
        "nvlink_errors", "nvlink_errors", "nvlink_errors", "nvlink_down", "nvlink_down", "thermal_throttle",
        "power_brake", "power_cap", "ecc_corrected_growth", "ecc_uncorrectable", "row_remap_pending",
        "row_remap_failure", "gpu_lost", "reset_required", "temperature_drift", "hot_hbm", "pcie_replay",
        "memory_bound", "busy_spin", "under_load", "fabric_manager_down", "fabric_degraded",
        "pcie_link_degraded", "recovery_action", "config_drift", "nvml_unavailable"))
    f: dict[str, Any] = {"kind": kind, "at_seconds": at}
    if kind not in ("fabric_manager_down", "config_drift", "nvml_unavailable"):
        f["gpu"] = gpu
    match kind:
        case "nvlink_errors":
            f |= {"link": rng.randrange(links), "rate_per_second": rng.uniform(0.001, 5.0),
                  "error_type": rng.choice(("crc", "replay", "recovery"))}
        case "nvlink_down":
            f["link"] = rng.randrange(links)
        case "thermal_throttle" | "power_brake":
            f |= {"duration_seconds": rng.uniform(10, 900), "clock_ratio": rng.uniform(0.2, 1.0)}
        case "power_cap":
            f |= {"duration_seconds": duration, "clock_ratio": rng.uniform(0.3, 1.0)}
        case "ecc_corrected_growth" | "pcie_replay":
            f |= {"rate_per_second": rng.uniform(0.001, 3.0), "duration_seconds": duration}
        case "ecc_uncorrectable":
            f["count"] = rng.randint(1, 5)
        case "row_remap_pending":
            f["rows"] = rng.randint(1, 4)
        case "temperature_drift":
            f |= {"celsius_per_hour": rng.uniform(1, 100), "duration_seconds": duration}
        case "hot_hbm":
            f |= {"extra_celsius": rng.uniform(1, 30), "duration_seconds": duration}
        case "memory_bound":
            f |= {"dram_active_ratio": rng.uniform(0.5, 1.0), "duration_seconds": duration}
        case "busy_spin":
            f["duration_seconds"] = duration
        case "under_load":
            f |= {"sm_clock_factor": rng.uniform(0.3, 0.9), "throttle": rng.choice(("thermal", "power_brake", "none")),
                  "duration_seconds": duration}
        case "fabric_manager_down":
            f |= {"state": rng.choice(("not_started", "in_progress")), "duration_seconds": duration}
        case "fabric_degraded":
            f |= {"conditions": rng.sample(_CONDITIONS, rng.randint(1, 4)), "duration_seconds": duration}
        case "pcie_link_degraded":
            f |= {"width": rng.choice((None, 4, 8)), "generation": rng.choice((1, 2, 3))}
        case "recovery_action":
            f |= {"action": rng.choice(_ACTIONS), "duration_seconds": duration}
        case "config_drift":
            f |= {"power_limit_watts": rng.uniform(200, 700)}
        case "nvml_unavailable":
            f["at_seconds"] = rng.uniform(1200, 3600)
    return f


def random_scenario(seed: int) -> NodeScenario:
    rng = random.Random(seed)
    profile = PROFILES[rng.choice(sorted(PROFILES))]
    gpus = rng.randint(1, 8)
    data: dict[str, Any] = {
        "profile": profile.key, "gpus": gpus,
        "load": {"utilization": rng.choice((0.0, rng.uniform(0.2, 1.0))), "noise": rng.uniform(0, 0.3),
                 "memory_used_ratio": rng.uniform(0, 0.9), "workload": rng.choice(("training", "memory_bound"))},
        "faults": [], "mig": []}
    for _ in range(rng.randint(4, 16)):
        fault = _fault(rng, gpus, profile.nvlink_count)
        try:  # a fault the board cannot show (fabric on a V100, a too-wide link) is drawn again
            parse_node_scenario({**data, "faults": [*data["faults"], fault]})
        except ValueError:
            continue
        data["faults"].append(fault)
    if profile.mig_profiles:
        for gpu in rng.sample(range(gpus), rng.randint(0, min(gpus, 2))):
            names = [n for n, _ in profile.mig_profiles]
            instances: list[str] = []
            for _ in range(rng.randint(0, 3)):
                name = rng.choice(names)
                layout = {"gpu": gpu, "instances": [*instances, name]}
                try:
                    parse_node_scenario({**data, "mig": [*data["mig"], layout]})
                except ValueError:
                    continue
                instances.append(name)
            data["mig"].append({"gpu": gpu, "enabled": True, "instances": instances,
                                "pending": rng.choice((None, False))})
    return parse_node_scenario(data)


_ENCODE = msgspec.json.Encoder(order="deterministic")


def run_digest(seed: int, cycles: int = 40) -> str:
    """Every cycle's samples, report section and events over a randomized run, digested."""
    rng = random.Random(seed * 7919 + 1)
    scenario = random_scenario(seed)
    clock = Clock()
    fake = FakeNvml(scenario, clock, start=0.0, seed=seed)
    backend = PynvmlBackend(fake)
    backend.init()
    collector = GpuCollector(GpuConfig(xid_events=False, nvlink_interval_seconds=rng.choice((10.0, 60.0))),
                             backend, clock)
    digest = hashlib.sha256()
    gpus = scenario.gpus
    try:
        for _ in range(cycles):
            clock.t += rng.choice((2.5, 5.0, 10.0, 30.0, 60.0, 300.0))
            roll = rng.random()
            some = rng.sample(range(gpus), rng.randint(1, gpus))
            if roll < 0.15:
                fake.set_utilization(some, rng.choice((None, 0.0, rng.random())))
            elif roll < 0.22:
                fake.set_busy_spin(some, rng.random() < 0.5)
            elif roll < 0.30:
                fake.begin_load(some[0])
            elif roll < 0.36:
                fake.end_load(some[0])
            elif roll < 0.42:
                fake.running_pids[some[0]] = [rng.randint(100, 9999)]
            elif roll < 0.48:
                fake.running_pids.pop(some[0], None)
                try:
                    backend.reset_gpu(some[0])
                except Exception as exc:  # noqa: BLE001 - a refused reset is part of the record
                    digest.update(f"reset:{type(exc).__name__}".encode())
            collection = collector.collect(clock())
            digest.update(_ENCODE.encode([
                [(s.name, repr(s.value), s.labels) for s in collection.samples],
                collection.report,
                collection.events]))
    finally:
        collector.close()
    return digest.hexdigest()


# Recorded on the unchanged read path (commit 51b9bcc), 40 cycles each.
RECORDED: dict[int, str] = {
    0: "43096ca84acfb4041a2c35c351bcf0b2bf1aae78c193222439b28af873332bbe",
    1: "1ea3c1eadda3aba54cca7ad0dcd379af4bda1ab627b06bc12d24806b18661300",
    2: "3fd6741b9ec79210765cf03159d5e28363929161bbf56b1a918f3d66b69937dd",
    3: "d74274e88995b7f5115ee341d2636a3d13b6126ca8a6d7cbdf4031293515bbe5",
    4: "328ab433ebe3992f7a0c5e4b2ed58f5c43c60f430e528910666c561a10cc57c2",
    5: "f106286edee5caa9ca618ce9ee80736454477248dd5250e6e04468174759082a",
    6: "a6cfe3108a619ca00a8c75cadd49fa0fccbea6b5cee87c51123bcef6c826588f",
    7: "fc892560b8fdb54c3d571e3a2dc88b9d2a11a323e3bc53568a75b4a1b58c1f55",
    8: "e3dd7f2dfee45f93c3e7a02ab2c708cdf9007a55376832b7c11d908d3c6e1b7c",
    9: "ce82865df68a92121cb72e468ec84095646e18bb08ea4a00372b77ee753f3bdd",
    10: "52ff97f486d29c50522e4bd21bc69f2b3f223de8b7dfb035ed059a316eda95e8",
    11: "5011ef50370fd0a4c4b69131a6907edeadd82b161a292b4f5141d75270818ff3",
    12: "29e866a7e70d443c89e203967b816e785d599980476417adb3929ca52af402e4",
    13: "b8de253f5960e5737644030cb84dfd02335a91c5baf2a54730ed112171510f89",
    14: "88f149f2ffae5ad15d2a47109a581fed72ca13b5eee10a90a964fc605130ec1f",
    15: "7d2d8373804e0d5728b8e234699b4d59dafd22dcf4b4a152ad205a3bd1580cdc",
    16: "97406270555a9809b4bcc42a805f4d3451a433df47257373c820677401a75bf1",
    17: "8c1f16d2fd57ee7dbe2ed9c45bc8bf378f06921479d0ab0d3243fd780b830c6a",
    18: "7b4779c07b22b1f5063458370fc7a91221540f014ae22b3645d9a2c54f4c7221",
    19: "cc513ad3184ae150a20f81724a71f5ca3fc2cba6f6f891a30a8a39c133d79490",
    20: "1313226d954b5df9948771c14256ceb5bbc429e1eab834ebb2cb6282d53d08dd",
    21: "c00219605938b24f9d06344dd096eb699c2cd767b52bd066149a5ddcdf12947e",
    22: "723893e81d950da297e14015f9fec90f0c616ea0c24fd336fbf7d947cb3b7c2c",
    23: "dd44611cc09454142da5378e4ca751c5ccc8e7b5a8ea67ba7a8705041cd1a855",
}


@pytest.mark.parametrize("seed", sorted(RECORDED))
def test_the_collector_says_what_it_said_before(seed: int) -> None:
    assert run_digest(seed) == RECORDED[seed]


def test_the_randomized_fleets_cover_what_the_fast_paths_skip() -> None:
    """The recorded seeds draw the states a shortcut could get wrong: links down and erring, MIG,
    lost GPUs, throttle windows, and NVML gone."""
    kinds: set[str] = set()
    mig = False
    for seed in RECORDED:
        sc = random_scenario(seed)
        kinds |= {f.kind for f in sc.faults}
        mig = mig or any(m.instances for m in sc.mig)
    assert {"nvlink_errors", "nvlink_down", "gpu_lost", "thermal_throttle", "power_cap",
            "nvml_unavailable", "reset_required"} <= kinds
    assert mig


if __name__ == "__main__":  # regenerate: python tests/agent/collectors/test_gpu_fleet_equivalence.py
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 24
    print("RECORDED: dict[int, str] = {")
    for s in range(count):
        print(f"    {s}: \"{run_digest(s)}\",")
    print("}")

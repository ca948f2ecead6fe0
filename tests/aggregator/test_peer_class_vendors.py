"""One fleet, two vendors: the hardware class keeps AMD and NVIDIA GPUs apart, so an MI300X's
different clocks, power and step time are never "slow" against H100s (issue 46)."""

from __future__ import annotations

from tests.aggregator.conftest import FakeNode
from tests.aggregator.detectors.test_gpu_peer import drive, nodes_
from tests.aggregator.detectors.test_straggler_peers import Job, removals
from vigil.aggregator.decision import REMOVING_ACTIONS, Action
from vigil.aggregator.detectors.gpu_peer import GpuPeerConfig, GpuPeerDetector
from vigil.aggregator.detectors.peer_class import describe, gpu_model, hardware_class
from vigil.aggregator.detectors.straggler import StragglerConfig
from vigil.aggregator.fleet import Fleet

MI300X = "AMD Instinct MI300X"


def as_mi300x(node: FakeNode, *, clock_ratio: float = 0.8) -> None:
    """An 8x MI300X node as the AMD backend reports it: 2,100 MHz peak graphics clock, 750 W cap,
    running below its peak under a training load (modelled in agent/amdsmi/profiles.py)."""
    for g in node.gpus.values():
        g.update(name=MI300X, vendor="amd", sm_clock_max_hertz=2.1e9, sm_clock_hertz=2.1e9 * clock_ratio,
                 power_limit_watts=750.0, power_watts=700.0, nvlink_links_active=7)


def test_vendors_are_different_classes_even_without_a_model_name() -> None:
    nvidia, amd = FakeNode("nv", gpus=1), FakeNode("amd", gpus=1)
    for node, vendor in ((nvidia, "nvidia"), (amd, "amd")):
        node.gpus[0].update(vendor=vendor, sm_clock_max_hertz=1.98e9)
        node.gpus[0].pop("name", None)
    fleet = Fleet()
    for node in (nvidia, amd):
        fleet.ingest(node.report(0.0), 0.0)
    view = fleet.view()
    assert hardware_class(view.nodes["nv"]) != hardware_class(view.nodes["amd"])
    assert describe(hardware_class(view.nodes["amd"])).startswith("amd")
    # Named GPUs keep their library's name; another vendor's name is qualified.
    assert gpu_model(MI300X, "amd") == MI300X and gpu_model("NVIDIA H100 80GB HBM3", "nvidia").startswith("NVIDIA")
    assert gpu_model("Instinct MI300X", "amd") == "amd Instinct MI300X" and gpu_model(None, None) == ""


def test_mi300x_clocks_never_flag_against_h100_peers() -> None:
    # Two MI300X nodes among seven in one job, at 70% of their own peak (1.47 GHz, power-bound,
    # against the H100s' ~1.95 GHz): judged among their own class, nothing differs.
    def mutate(n: FakeNode, t: float) -> None:
        if n.name in ("n2", "n5"):
            as_mi300x(n, clock_ratio=0.7)
    fleet, now = drive(nodes_(7), 120.0, mutate=mutate)
    found = GpuPeerDetector(GpuPeerConfig()).evaluate(fleet.view(), now)
    assert [f for f in found if f.action is not Action.OBSERVE] == []
    # The control: one class for the whole job flags them (this test can fail).
    fleet, now = drive(nodes_(7), 120.0, mutate=mutate)
    whole_job = GpuPeerDetector(GpuPeerConfig(by_hardware_class=False)).evaluate(fleet.view(), now)
    flagged = {f.node for f in whole_job if f.action is Action.ALERT}
    assert flagged and flagged <= {"n2", "n5"}


def test_mi300x_step_time_is_never_a_straggler_among_h100s() -> None:
    # 6 MI300X nodes of 64 computing 12% longer by design (as H100s among H200s in
    # test_straggler_peers): never removed when classes are compared, all drained when not.
    def job() -> Job:
        j = Job(64, h100=6)
        for node in j.nodes[58:]:
            as_mi300x(node, clock_ratio=1.0)
        for node in j.nodes[:58]:
            for g in node.gpus.values():
                g.update(name="NVIDIA H100 80GB HBM3", vendor="nvidia")
        return j
    found = job().run(60.0)
    assert removals(found) == {}
    assert not [f for _, fs in found for f in fs if f.action in REMOVING_ACTIONS]
    assert set(removals(job().run(60.0, StragglerConfig(by_hardware_class=False)))) == \
        {f"n{i:03d}" for i in range(58, 64)}

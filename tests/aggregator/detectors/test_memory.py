from tests.aggregator.conftest import FakeNode
from vigil.aggregator.decision import Action
from vigil.aggregator.detectors.memory import MemoryConfig, MemoryDetector
from vigil.aggregator.fleet import Fleet

DETECTOR = MemoryDetector(MemoryConfig())


def drive(node, fleet, start, end, change=None):
    t = start
    while t <= end:
        if change is not None:
            change(t)
        fleet.ingest(node.report(t), t)
        t += 2.5
    return t - 2.5


def judge(change=None, end=600.0, node=None):
    node = node or FakeNode("a")
    fleet = Fleet()
    last = drive(node, fleet, 0.0, end, change)
    return DETECTOR.evaluate(fleet.view(), last)


def test_healthy_gpus_produce_nothing():
    assert judge() == []


def test_steady_trickle_of_corrected_errors_is_its_baseline():
    node = FakeNode("a")

    def trickle(t):
        node.gpus[0]["ecc_corrected_volatile"] = int(t)  # 0.4 per report, all along
    assert judge(trickle, node=node) == []


def test_corrected_error_surge_against_own_baseline_drains():
    node = FakeNode("a")

    def surge(t):
        g = node.gpus[4]
        g["ecc_corrected_volatile"] += 1 if t < 500 else 40
    [f] = judge(surge, node=node)
    assert (f.action, f.gpu, f.key) == (Action.DRAIN, 4, "corrected_surge")
    assert f.evidence["signal"] == "ecc_corrected_rate"
    assert f.since >= 500


def test_high_but_constant_corrected_rate_is_not_a_surge():
    node = FakeNode("a")

    def constant(t):
        node.gpus[4]["ecc_corrected_volatile"] += 40
    assert judge(constant, node=node) == []


def test_uncorrectable_error_drains():
    node = FakeNode("a")

    def dbe(t):
        if t == 300:
            node.gpus[2]["ecc_uncorrected_volatile"] = 1
    [f] = judge(dbe, node=node)
    assert (f.action, f.gpu, f.evidence["signal"], f.since) == (Action.DRAIN, 2, "ecc_uncorrected", 300.0)


def test_remap_pending_resets_and_remap_failure_inspects():
    node = FakeNode("a")

    def flags(t):
        if t >= 100:
            node.gpus[1]["remap_pending"] = True
            node.gpus[1]["ecc_uncorrected_volatile"] = 2
            node.gpus[3]["remap_failure"] = True
    found = {(f.gpu, f.action, f.key) for f in judge(flags, node=node)}
    # the uncorrectable errors are explained by the pending remap: one decision, a reset
    assert found == {(1, Action.RESET_GPU, "remap_pending"), (3, Action.INSPECT_HARDWARE, "remap_failure")}


def test_retired_page_limit_and_pending_retirement():
    node = FakeNode("a")
    node.gpus[0]["retired_pages_dbe"] = 61
    node.gpus[5]["retired_pages_pending"] = True
    found = {(f.gpu, f.action) for f in judge(node=node, end=10.0)}
    assert found == {(0, Action.INSPECT_HARDWARE), (5, Action.RESET_GPU)}


def test_ecc_counters_reset_by_reboot_are_not_errors():
    node = FakeNode("a")
    node.gpus[0]["ecc_uncorrected_volatile"] = 3
    fleet = Fleet()
    drive(node, fleet, 0.0, 50.0)
    node.reboot()
    last = drive(node, fleet, 52.5, 100.0)
    assert DETECTOR.evaluate(fleet.view(), last) == []

from tests.aggregator.conftest import FakeNode, rank_summary
from vigil.aggregator.fleet import Fleet, FleetConfig
from vigil.contract.wire import Event


def test_counter_deltas_between_reports_of_one_boot():
    fleet, node = Fleet(), FakeNode("n1")
    fleet.ingest(node.report(0.0), 0.0)
    node.gpus[3]["ecc_corrected_volatile"] = 7
    fleet.ingest(node.report(2.5), 2.5)
    gpu = fleet.view().nodes["n1"].gpus[3]
    assert gpu.counters.sum_since("ecc_corrected_volatile", 0.0) == 7
    assert fleet.view().nodes["n1"].gpus[2].counters.sum_since("ecc_corrected_volatile", 0.0) == 0


def test_reboot_resets_baseline_without_an_error_burst():
    fleet, node = Fleet(), FakeNode("n1")
    node.gpus[0]["ecc_corrected_volatile"] = 5000
    node.ports[0]["counters"]["symbol_error"] = 900
    fleet.ingest(node.report(0.0), 0.0)
    node.reboot()
    fleet.ingest(node.report(60.0), 60.0)
    node.gpus[0]["ecc_corrected_volatile"] = 2
    fleet.ingest(node.report(62.5), 62.5)
    state = fleet.view().nodes["n1"]
    assert state.reboots == 1 and state.seq_gaps == 0
    assert state.gpus[0].counters.sum_since("ecc_corrected_volatile", 0.0) == 2
    assert state.ports[("mlx5_0", 1)].counters.sum_since("symbol_error", 0.0) == 0


def test_counter_going_backwards_in_one_boot_is_a_reset_not_a_delta():
    fleet, node = Fleet(), FakeNode("n1")
    node.gpus[0]["pcie_replay_total"] = 100
    fleet.ingest(node.report(0.0), 0.0)
    node.gpus[0]["pcie_replay_total"] = 3
    fleet.ingest(node.report(2.5), 2.5)
    gpu = fleet.view().nodes["n1"].gpus[0]
    assert gpu.counters.resets == 1
    assert gpu.counters.sum_since("pcie_replay_total", 0.0) == 0


def test_seq_gap_is_noted_and_replayed_report_does_not_rewind_counters():
    fleet, node = Fleet(), FakeNode("n1")
    fleet.ingest(node.report(0.0), 0.0)
    node.seq += 2  # two reports lost
    node.gpus[0]["ecc_corrected_volatile"] = 10
    fleet.ingest(node.report(7.5), 7.5)
    old = node.report(7.5)
    old.seq = 1
    old.gpus[0].ecc_corrected_volatile = 0
    fleet.ingest(old, 8.0)
    state = fleet.view().nodes["n1"]
    assert state.seq_gaps == 1
    assert state.seq == 4
    assert state.gpus[0].last.ecc_corrected_volatile == 10


def test_gpu_missing_from_a_report_is_tracked_until_it_returns():
    fleet, node = Fleet(), FakeNode("n1")
    fleet.ingest(node.report(0.0), 0.0)
    fleet.ingest(node.report(2.5, drop_gpus=(5,)), 2.5)
    assert fleet.view().nodes["n1"].missing_gpus == {5: 2.5}
    fleet.ingest(node.report(5.0), 5.0)
    assert fleet.view().nodes["n1"].missing_gpus == {}


def test_gpu_absence_while_nvml_is_down_is_not_a_missing_gpu():
    fleet, node = Fleet(), FakeNode("n1")
    fleet.ingest(node.report(0.0), 0.0)
    node.nvml_available = False
    fleet.ingest(node.report(2.5, drop_gpus=tuple(range(8))), 2.5)
    state = fleet.view().nodes["n1"]
    assert state.missing_gpus == {}
    assert state.nvml_down_since == 2.5


def test_xid_seen_by_kmsg_and_nvml_is_recorded_once():
    fleet, node = Fleet(FleetConfig(xid_dedup_seconds=5.0)), FakeNode("n1")
    events = [Event(kind="xid", ts=10.0, code=79, pci_bus_id="00000000:1A:00.0", source="kmsg"),
              Event(kind="xid", ts=11.2, code=79, gpu=2, source="nvml")]
    fleet.ingest(node.report(0.0), 0.0)
    fleet.ingest(node.report(12.0, events=events), 12.0)
    records = fleet.view().nodes["n1"].xids[2]
    assert len(records) == 1
    assert records[0].sources == {"kmsg", "nvml"}
    fleet.ingest(node.report(30.0, events=[Event(kind="xid", ts=29.0, code=79, gpu=2, source="kmsg")]), 30.0)
    assert len(fleet.view().nodes["n1"].xids[2]) == 2


def test_job_membership_follows_rank_summaries_and_idle_jobs_are_forgotten():
    fleet = Fleet(FleetConfig(job_forget_seconds=100.0))
    a, b = FakeNode("a"), FakeNode("b")
    a.ranks = [rank_summary("j", 0, compute=1, comm=0.1, ts=0.0)]
    b.ranks = [rank_summary("j", 1, compute=1, comm=0.1, ts=0.0)]
    fleet.ingest(a.report(0.0), 0.0)
    fleet.ingest(b.report(0.0), 0.0)
    assert fleet.view().jobs["j"].nodes() == {"a", "b"}
    # rank 1 moves to node a (job restarted elsewhere): its process on b ended first
    b.ranks = [rank_summary("j", 1, compute=1, comm=0.1, ts=2.5, state="exited")]
    fleet.ingest(b.report(2.5), 2.5)
    a.ranks.append(rank_summary("j", 1, compute=1, comm=0.1, ts=5.0))
    fleet.ingest(a.report(5.0), 5.0)
    assert fleet.view().jobs["j"].nodes() == {"a"}
    assert ("j", 1) not in fleet.view().nodes["b"].ranks
    fleet.forget_idle_jobs(200.0)
    assert "j" not in fleet.view().jobs
    assert fleet.view().nodes["a"].ranks == {}


def test_history_is_bounded():
    fleet, node = Fleet(FleetConfig(history_reports=10, state_history_reports=10)), FakeNode("n1", gpus=1, ports=1)
    for i in range(50):
        node.gpus[0]["ecc_corrected_volatile"] = i
        fleet.ingest(node.report(i * 2.5), i * 2.5)
    gpu = fleet.view().nodes["n1"].gpus[0]
    assert len(gpu.samples) == 10
    # 49 increases of 1 happened; the ring keeps the last 10 and knows they cover 25 s
    assert gpu.counters.sum_since("ecc_corrected_volatile", 0.0) == 10
    assert gpu.counters.baseline_since("ecc_corrected_volatile") == 40 * 2.5


def test_topology_members():
    fleet = Fleet()
    for i in range(4):
        n = FakeNode(f"n{i}", topology={"leaf_switch": f"leaf-{i // 2}", "rack": "r1"})
        fleet.ingest(n.report(0.0), 0.0)
    view = fleet.view()
    assert view.members("leaf_switch", "leaf-1") == ["n2", "n3"]
    assert len(view.members("rack", "r1")) == 4

"""NCCL's own words as hang evidence: a job stopped with no single culprit whose NCCL log events
(real NET/IB and RAS lines, parsed by the agent's reader) from two witnesses name one node gets
that node named and alerted, never drained; one rank's warning, a job that keeps training, a
node naming itself and an address two nodes claim name nobody."""

from __future__ import annotations

from pathlib import Path

from tests.aggregator.conftest import FakeNode, set_training
from vigil.agent.app_log import AppLogSignals
from vigil.aggregator.decision import WHOLE_JOB, Action
from vigil.aggregator.detectors.hang import HangConfig, HangDetector
from vigil.aggregator.fleet import Fleet
from vigil.contract.wire import Event

INTERVAL = 2.5
ROOT = Path(__file__).parent.parent.parent / "fixtures"
# NVIDIA/nccl#1405: "NET/IB : Got completion from peer 10.216.210.236<54862> with status=12 ..."
NET_IB = (ROOT / "app-signals" / "nccl-warn.log").read_text().splitlines()[0]
RAS = (ROOT / "nccl" / "ras-nccl-1762-incomplete.txt").read_text().splitlines()  # names 10.4.109.13


def events_of(lines: list[str], job: str = "job", *, rank_prefix: int | None = None) -> list[Event]:
    """What the agent's log reader forwards for these lines (a torch "[rankN]:" prefix optional)."""
    signals = AppLogSignals(job)
    for line in lines:
        signals.feed(line if rank_prefix is None else f"[rank{rank_prefix}]: {line}", 0.0)
    return signals.drain(0.0)


def run(logged: dict[str, list[Event]], *, at: float = 95.0, stop_at: float | None = 100.0, until: float = 130.0,
        addresses: dict[str, str] | None = None, early: dict[str, float] | None = None):
    """Four nodes, two ranks each, training until ``stop_at`` (all together: no culprit from the
    steps; ``early`` node -> its own earlier stop). ``logged`` node -> events its agent forwards in
    its report at ``at``. Returns the findings of the last evaluation."""
    addresses = addresses if addresses is not None else {"n2": "10.4.109.13", "n3": "10.216.210.236,10.1.0.3"}
    nodes = [FakeNode(f"n{i}", gpus=0, ports=0, topology={"addresses": addresses[f"n{i}"]}
                      if f"n{i}" in addresses else None) for i in range(4)]
    detector = HangDetector(HangConfig())
    fleet = Fleet()
    t = 0.0
    found: list = []
    while t <= until:
        set_training(nodes, "job", t, ranks_per_node=2, step=int(t))
        for n in nodes:
            stop = (early or {}).get(n.name, stop_at)
            if stop is not None and t >= stop:
                for r in n.ranks:
                    r.last_progress_ts, r.last_step = stop, int(stop)
            events = [Event(**{**_fields(e), "ts": t}) for e in logged.get(n.name, [])] if t == at else []
            fleet.ingest(n.report(t, events=events), t)
        found = detector.evaluate(fleet.view(), t)
        t += INTERVAL
    return found


def _fields(e: Event) -> dict:
    return {f: getattr(e, f) for f in e.__struct_fields__}


def test_net_ib_errors_of_two_ranks_naming_one_node_make_it_the_suspect_alerted_not_drained():
    found = run({"n0": events_of([NET_IB], rank_prefix=0), "n1": events_of([NET_IB], rank_prefix=2)})
    assert sorted((f.action, f.node) for f in found) == [(Action.ALERT, WHOLE_JOB), (Action.ALERT, "n3")]
    job = next(f for f in found if f.node == WHOLE_JOB)
    assert job.evidence["nccl_suspect"] == {"peer": "10.216.210.236", "node": "n3", "witnesses": 2}
    assert "name peer 10.216.210.236 (node n3)" in job.reason
    assert sorted((e["kind"], e["rank"], e["node"], e["reported_by"]) for e in job.evidence["nccl_events"]) == [
        ("nccl_warn", 0, "n3", "n0"), ("nccl_warn", 2, "n3", "n1")]
    node = next(f for f in found if f.node == "n3")
    assert (node.key, node.job, node.evidence["signal"], node.evidence["witnesses"]) == ("hang", "job", "nccl_logs", 2)


def test_ras_reports_on_two_nodes_name_the_unresponsive_node():
    found = run({"n0": events_of(RAS), "n1": events_of(RAS)})
    job = next(f for f in found if f.node == WHOLE_JOB)
    assert job.evidence["nccl_suspect"] == {"peer": "10.4.109.13", "node": "n2", "witnesses": 2}
    assert [(f.action, f.node) for f in found if f.node != WHOLE_JOB] == [(Action.ALERT, "n2")]
    assert {e["kind"] for e in job.evidence["nccl_events"]} == {"nccl_ras"}


def test_a_peer_named_by_one_rank_is_evidence_but_no_suspect():
    found = run({"n0": events_of([NET_IB, NET_IB], rank_prefix=0)})
    assert [(f.action, f.node) for f in found] == [(Action.ALERT, WHOLE_JOB)]
    assert found[0].evidence["nccl_suspect"] is None and len(found[0].evidence["nccl_events"]) == 1


def test_a_transient_warning_in_a_job_that_keeps_training_names_nobody():
    assert run({"n0": events_of([NET_IB], rank_prefix=0), "n1": events_of([NET_IB], rank_prefix=2)},
               stop_at=None) == []


def test_events_long_before_the_stop_or_of_another_job_are_not_evidence():
    found = run({"n0": events_of([NET_IB], rank_prefix=0), "n1": events_of([NET_IB], rank_prefix=2)}, at=20.0)
    assert found[0].evidence["nccl_events"] == [] and found[0].evidence["nccl_suspect"] is None
    found = run({"n0": events_of([NET_IB], "other", rank_prefix=0), "n1": events_of([NET_IB], "other", rank_prefix=2)})
    assert found[0].evidence["nccl_events"] == [] and len(found) == 1


def test_a_node_never_witnesses_against_itself_and_a_shared_address_resolves_to_no_node():
    found = run({"n3": events_of([NET_IB], rank_prefix=6), "n0": events_of([NET_IB], rank_prefix=0)})
    assert found[0].evidence["nccl_suspect"] is None and len(found) == 1
    # n1 claims n3's address too: the address names no node; the peer is still named in the reason.
    found = run({"n0": events_of([NET_IB], rank_prefix=0), "n1": events_of([NET_IB], rank_prefix=2)},
                addresses={"n1": "10.216.210.236", "n3": "10.216.210.236"})
    assert [(f.action, f.node) for f in found] == [(Action.ALERT, WHOLE_JOB)]
    assert found[0].evidence["nccl_suspect"] == {"peer": "10.216.210.236", "node": None, "witnesses": 2}
    assert "(no node vigil knows)" in found[0].reason


def test_a_culprit_from_the_steps_carries_the_nccl_events_and_nothing_more():
    # n3 stopped 40 s before the rest: the step rule drains it; the NCCL events ride along as evidence.
    found = run({"n0": events_of([NET_IB], rank_prefix=0), "n1": events_of([NET_IB], rank_prefix=2)},
                early={"n3": 60.0}, until=140.0)
    assert sorted((f.action, f.node) for f in found) == [(Action.DRAIN, "n3"), (Action.RESTART_JOB, WHOLE_JOB)]
    assert all(len(f.evidence["nccl_events"]) == 2 and "nccl_suspect" not in f.evidence for f in found)



def test_watchdog_timeouts_are_evidence_but_name_no_peer():
    timeouts = (ROOT / "app-signals" / "torch-nccl-timeout.log").read_text().splitlines()[:2]  # ranks 0 and 4
    found = run({"n0": events_of(timeouts[:1]), "n2": events_of(timeouts[1:])})
    assert [(f.action, f.node) for f in found] == [(Action.ALERT, WHOLE_JOB)]
    assert sorted((e["kind"], e["rank"], e["peer"]) for e in found[0].evidence["nccl_events"]) == [
        ("nccl_timeout", 0, None), ("nccl_timeout", 4, None)]
    assert found[0].evidence["nccl_suspect"] is None

"""The goodput ledger (sim/goodput.py): job-progress restarts, the three arms, the real-time accounting."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.sim.conftest import raw
from vigil.cli import main
from vigil.sim.goodput import Horizon, JobProgress, Ledger, incidents, ledger, measured_slowdowns
from vigil.sim.run import JobTrace, SimDecision, run_scenario
from vigil.sim.scenario import Scenario, load_scenario, parse_scenario

GPUS = 16 * 8  # the test job: 16 nodes x 8 GPUs


def _scenario(faults: list[dict[str, Any]], *, goodput: dict[str, Any] | None = None,
              job: dict[str, Any] | None = None) -> Scenario:
    return parse_scenario({
        "name": "goodput-unit", "duration_seconds": 3600,
        "fleet": {"nodes": 20, "gpus_per_node": 8},
        "goodput": {"represents_seconds": 604800, "represents_nodes": 1000, **(goodput or {})},
        "jobs": [{"name": "llm", "nodes": "node-0000..node-0015", "step_seconds": 2.0, **(job or {})}],
        "faults": faults,
    })


def _d(t: float, action: str, node: str | None = "node-0003", *, admitted: bool = True,
       **evidence: Any) -> SimDecision:
    return SimDecision(t=t, ts=t, id="", node=node, action=action, detector="test", reason="", admitted=admitted,
                       verdict="admitted" if admitted else "refused", job="llm", evidence=dict(evidence))


XID_AT_100 = [{"kind": "kernel_xid", "node": "node-0003", "gpu": 2, "code": 79, "at_seconds": 100}]
# Face value: the straggler runs on to the window's end (no real-rate restarts), easy to check by hand.
_FACE = Horizon(0.0, 3600.0, face_value_end=3600.0)


def _stages(ledger_: Ledger, arm: str, fault: int = 0) -> dict[str, float]:
    inc = ledger_.incidents[fault]
    return ledger_.loss(inc, arm, ledger_._horizon(ledger_.base_rate_per_1000_node_days)).stages


def test_lost_work_is_the_work_since_the_last_checkpoint_at_the_jobs_own_cadence() -> None:
    default = JobProgress(_scenario([]))
    assert default.cadence("llm") == 1800.0 and default.since_checkpoint("llm", 2000.0) == 200.0
    paused = JobProgress(_scenario([], job={"pauses": [{"kind": "checkpoint", "every_seconds": 600, "seconds": 10,
                                                        "first_at_seconds": 50}]}))
    assert paused.cadence("llm") == 600.0 and paused.since_checkpoint("llm", 700.0) == 50.0
    own = JobProgress(_scenario([], job={"restart_seconds": 120}))
    assert own.restart_seconds("llm") == 120.0 and default.restart_seconds("llm") == 600.0


def test_crash_without_vigil_waits_for_the_watchdog_then_a_person() -> None:
    led = Ledger(_scenario(XID_AT_100), [])
    stages = _stages(led, "no_vigil")
    # Blocked from 100 s; NCCL's watchdog at 700 s; restarts land on the lost GPU for a person's hour.
    assert stages["detection"] == pytest.approx(GPUS * (600 + 3600))
    assert stages["restart"] == pytest.approx(GPUS * 600) and stages["lost_work"] == pytest.approx(GPUS * 100)
    # Vigil deciding nothing is no better and no worse.
    assert _stages(led, "vigil") == stages


def test_crash_vigil_restart_excluding_the_node_ends_the_stall_at_its_decision() -> None:
    led = Ledger(_scenario(XID_AT_100), [_d(103, "alert"), _d(130, "restart_job", when="now", exclude=["node-0003"])])
    stages = _stages(led, "vigil")
    assert stages["detection"] == pytest.approx(GPUS * 3) and stages["drain"] == pytest.approx(GPUS * 27)
    assert "gate" not in stages and stages["restart"] == pytest.approx(GPUS * 600)
    oracle = _stages(led, "oracle")
    assert oracle == {"restart": pytest.approx(GPUS * 600), "lost_work": pytest.approx(GPUS * 100)}


def test_crash_a_drain_alone_leaves_the_job_blocked_until_the_watchdog() -> None:
    """The issue's point: a drain keeps new work off the node, the job still waits on it."""
    led = Ledger(_scenario(XID_AT_100), [_d(110, "drain", admitted=False), _d(120, "drain")])
    stages = _stages(led, "vigil")
    assert stages["detection"] == pytest.approx(GPUS * 10) and stages["gate"] == pytest.approx(GPUS * 10)
    # Removed before the watchdog fired: the restart lands on a spare, no person's hour.
    assert stages["drain"] == pytest.approx(GPUS * 580)
    assert sum(stages.values()) < sum(_stages(led, "no_vigil").values())


def test_crash_without_a_spare_waits_for_the_node_to_return() -> None:
    led = Ledger(_scenario(XID_AT_100, goodput={"spare_available": False}),
                 [_d(130, "restart_job", exclude=["node-0003"])])
    assert _stages(led, "vigil")["verification"] == pytest.approx(GPUS * 3600)


def test_a_hold_books_the_persons_time() -> None:
    led = Ledger(_scenario([{"kind": "hang", "job": "llm", "at_seconds": 100, "until_seconds": 2000}]),
                 [_d(400, "hold_job", node=None)])
    stages = _stages(led, "vigil")
    # The others ran on 60 s (the hang's default others_continue_seconds), then blocked until the hold.
    assert stages["hold"] == pytest.approx(GPUS * 3600) and stages["detection"] == pytest.approx(GPUS * 240)
    assert stages["lost_work"] == pytest.approx(GPUS * 160)


SLOW_AT_100 = [{"kind": "slow_node", "node": "node-0003", "at_seconds": 100, "factor": 1.2}]


def test_straggler_slows_every_step_until_it_leaves_the_job() -> None:
    led = Ledger(_scenario(SLOW_AT_100), [_d(160, "drain"), _d(1800, "restart_job", when="checkpoint",
                                                                exclude=["node-0003"])])
    inc = incidents(led.scenario)[0]
    assert inc.effect == "slow" and inc.slowdown == pytest.approx(1 + 0.75 * 0.2)  # compute is 75% of a step
    rate = GPUS * (1 - 1 / inc.slowdown)
    stages = led.loss(inc, "vigil", _FACE).stages
    assert stages["detection"] == pytest.approx(rate * 60) and stages["drain"] == pytest.approx(rate * 1640)
    # Restarted at its checkpoint: no work lost.
    assert stages["restart"] == pytest.approx(GPUS * 600) and "lost_work" not in stages


def test_straggler_drained_but_never_restarted_straggles_until_the_next_restart() -> None:
    led = Ledger(_scenario(SLOW_AT_100), [_d(160, "drain")])
    inc = led.incidents[0]
    rate = GPUS * (1 - 1 / inc.slowdown)
    assert sum(led.loss(inc, "vigil", _FACE).stages.values()) == pytest.approx(rate * 3500)
    # At real rates the drained node leaves at the job's next interruption; undrained it stays.
    real = led._horizon(2.0)
    drained = sum(led.loss(inc, "vigil", real).stages.values())
    nobody = sum(Ledger(led.scenario, []).loss(inc, "vigil", real).stages.values())
    assert drained < nobody == pytest.approx(sum(led.loss(inc, "no_vigil", real).stages.values()))


def test_a_stragglers_slowdown_is_measured_on_its_job_as_it_ran() -> None:
    sc = _scenario([*SLOW_AT_100, {"kind": "hang", "job": "llm", "at_seconds": 250}])
    t = [float(x) for x in range(10, 400, 10)]
    # 2 s steps before the onset, 2.2 s after it settles; the hang at 250 s ends the clean window.
    trace = JobTrace("llm", [], t=t, step_seconds=[2.0 if x <= 100 else 2.2 if x < 250 else 9.0 for x in t])
    assert measured_slowdowns(sc, [trace]) == {0: pytest.approx(1.1)}
    led = Ledger(sc, [], measured_slowdown={0: 1.1})
    assert led.incidents[0].slowdown == 1.1 and Ledger(sc, []).incidents[0].slowdown == pytest.approx(1.15)
    # Too few windows after the onset: the model's figure stands.
    assert measured_slowdowns(sc, [JobTrace("llm", [], t=t[:11], step_seconds=[2.0] * 11)]) == {}


def test_oracle_picks_the_cheapest_moment_for_a_straggler() -> None:
    led = Ledger(_scenario(SLOW_AT_100), [])
    inc = led.incidents[0]
    oracle = sum(led.loss(inc, "oracle", _FACE).stages.values())
    assert oracle <= min(sum(led.loss(inc, arm, _FACE).stages.values()) for arm in ("vigil", "no_vigil"))
    rate = GPUS * (1 - 1 / inc.slowdown)
    # 3,500 s left in the window at 13% slow costs less than a restart (600 s + the 100 s since the checkpoint).
    assert oracle == pytest.approx(rate * 3500) and oracle < GPUS * (600 + 100)
    # A real week: the straggler would run on for days; restarting now beats waiting 1,700 s for the checkpoint.
    week = led.loss(inc, "oracle", led._horizon(1.0))
    assert week.stages == {"restart": pytest.approx(GPUS * 600), "lost_work": pytest.approx(GPUS * 100)}


def test_latent_fault_costs_only_what_vigil_does_to_the_job() -> None:
    """The lookalike: a drain of a node whose fault the job does not feel costs the job nothing."""
    latent = [{"kind": "ecc_corrected_growth", "node": "node-0003", "gpu": 1, "rate_per_second": 20,
               "at_seconds": 100}]
    drained = Ledger(_scenario(latent), [_d(150, "drain")])
    assert drained.incidents[0].effect == "none"
    assert all(_stages(drained, arm) == {} for arm in ("no_vigil", "vigil", "oracle"))
    rebooted = Ledger(_scenario(latent), [_d(150, "reboot_node")])
    assert _stages(rebooted, "vigil") == {"restart": pytest.approx(GPUS * 600), "lost_work": pytest.approx(GPUS * 150)}


def test_a_reboot_of_a_healthy_node_in_a_job_is_a_false_removal() -> None:
    led = Ledger(_scenario(XID_AT_100), [_d(200, "reboot_node", node="node-0007"), _d(210, "drain", node="node-0008")])
    (decision, loss, job), = led.false_removals()  # the drain stops nothing
    assert decision.node == "node-0007" and job == "llm"
    assert loss.stages == {"false_removal": pytest.approx(GPUS * (600 + 200))}


def test_real_time_accounting_scales_with_the_rate() -> None:
    led = Ledger(_scenario(XID_AT_100), [])
    # One fault for a week of 1,000 nodes: 1/7 interruption a day per 1,000 nodes.
    assert led.base_rate_per_1000_node_days == pytest.approx(1 / 7)
    one, two = led.account(1.0)["arms"]["vigil"], led.account(2.0)["arms"]["vigil"]
    assert two["gpu_hours_lost"] == pytest.approx(2 * one["gpu_hours_lost"], rel=1e-3)
    allocated = 1000 * 8 * 604800 / 3600.0
    assert one["ettr"] == pytest.approx(1 - one["gpu_hours_lost"] / allocated, abs=1e-5)
    # The job's own share of the rate: 16 of the fleet's 1,000 nodes.
    job_hours = 7 * 16 / 1000 * GPUS * (600 + 3600 + 600 + 100) / 3600.0
    assert one["jobs"]["llm"]["gpu_hours_lost"] == pytest.approx(job_hours, rel=1e-3)


def test_shipped_week_in_the_life_stands_for_a_real_week_at_llama3s_rate() -> None:
    led = Ledger(load_scenario("week-in-the-life"), [])
    # 26 faults replayed (of Llama 3's 27 a week on 1,024 nodes; silent data corruption shows no signal).
    assert 3.4 < led.base_rate_per_1000_node_days < 3.8
    assert {i.effect for i in led.incidents} == {"crash", "slow", "none"}


def test_goodput_small_through_the_real_engine(capsys: pytest.CaptureFixture[str]) -> None:
    """The shortened scenario of the ledger: vigil removes both nodes in time; the Xid's job restarts
    at vigil's reboot, the straggler's job runs on the drained node (no job-level restart yet)."""
    result = run_scenario(load_scenario("goodput-small"))
    g = ledger(result).to_json()
    arms = g["rates"][0]["arms"]
    assert arms["oracle"]["ettr"] >= arms["vigil"]["ettr"] >= arms["no_vigil"]["ettr"]
    xid, slow = g["incidents"]
    # The 15%-slow node as the run's job felt it: between 1 and the model's 1 + 0.75 x 0.15.
    assert 1.05 < ledger(result).incidents[1].slowdown < 1.1125
    assert xid["arms"]["vigil"]["gpu_hours"] < xid["arms"]["no_vigil"]["gpu_hours"]
    assert "drain" in slow["arms"]["vigil"]["stages_gpu_hours"]
    assert main(["sim", "--scenario", "goodput-small"]) == 0
    out = capsys.readouterr().out
    assert "goodput (real time" in out and "vigil    ETTR" in out and "by cause" in out


def test_sim_json_carries_goodput_only_where_the_scenario_says_what_it_stands_for(
        tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    import yaml

    data = raw("goodput-small")
    del data["goodput"]
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["sim", "--scenario", str(path), "--json", "--duration", "100"]) == 0
    assert "goodput" not in json.loads(capsys.readouterr().out)


@pytest.mark.slow
def test_week_in_the_life_vigil_meets_issue_40s_ettr() -> None:
    """`make bench`'s figure (bench/bench_goodput.py) as a test: the full run (about 5 min)."""
    g = ledger(run_scenario(load_scenario("week-in-the-life"))).to_json()
    for rate in g["rates"]:
        arms = rate["arms"]
        assert arms["oracle"]["ettr"] >= arms["vigil"]["ettr"] >= arms["no_vigil"]["ettr"]
        assert arms["vigil"]["ettr"] >= 0.98

"""The job-recovery planner through the simulator: the real agents report the job's announced
checkpoints, the real engine drains the straggler and the planner restarts its job without it at the
next completed checkpoint (not before); the goodput ledger books that restart at about the oracle's
cost, where the drain alone leaves the job slow."""

from __future__ import annotations

from vigil.sim.goodput import ledger
from vigil.sim.run import run_scenario
from vigil.sim.scenario import load_scenario, parse_scenario
from vigil.sim.score import score

SCENARIO = "goodput-restart-at-checkpoint"


def _checkpoint_ends(first: float, every: float, seconds: float, until: float) -> list[float]:
    ends, t = [], first
    while t < until:
        ends.append(t + seconds)
        t += every
    return ends


def test_the_straggler_s_job_restarts_without_it_at_its_next_checkpoint_at_about_the_oracle_s_cost() -> None:
    sc = load_scenario(SCENARIO)
    result = run_scenario(sc)
    s = score(result)
    assert s.passed, [r.why for r in s.removals]
    drain = next(d for d in result.decisions if d.action == "drain" and d.admitted)
    restarts = [d for d in result.decisions if d.detector == "job_recovery" and d.admitted]
    assert [(d.action, d.node, d.job) for d in restarts] == [("restart_job", "node-0011", "pretrain")]
    restart = restarts[0]
    assert restart.evidence["when"] == "checkpoint" and restart.evidence["exclude"] == ["node-0011"]
    # Not before: after the drain, and after the end of the first checkpoint that began after it.
    pause = sc.jobs[0].pauses[0]
    ends = _checkpoint_ends(pause.first_at_seconds, pause.every_seconds, pause.seconds, sc.duration_seconds)
    next_end = min(e for e in ends if e - pause.seconds >= drain.t)
    assert restart.t >= next_end > drain.t
    # The planner's own estimate chose waiting over restarting now.
    est = restart.evidence["estimate"]
    assert est["checkpoint"] < est["now"] and est["checkpoint"] < est["job_end"]
    arms = ledger(result).to_json()["incidents"][0]["arms"]
    vigil, oracle = arms["vigil"]["gpu_hours"], arms["oracle"]["gpu_hours"]
    assert "lost_work" not in arms["vigil"]["stages_gpu_hours"] and vigil <= oracle * 1.05
    # The same run with the planner off: the drain alone leaves the job slow.
    data = sc.model_dump(exclude_defaults=True)
    data["aggregator"] = {"job_recovery": {"enabled": False}}
    plain = run_scenario(parse_scenario(data, f"{SCENARIO}-planner-off"))
    assert not [d for d in plain.decisions if d.detector == "job_recovery"]
    assert ledger(plain).to_json()["incidents"][0]["arms"]["vigil"]["gpu_hours"] > 3 * vigil

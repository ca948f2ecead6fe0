"""Goodput: the week-in-the-life run's ETTR without vigil, with vigil as shipped and for an oracle.

Runs ``week-in-the-life`` (Llama 3's interruption mix, a week of a 1,024-node cluster replayed in
two simulated hours on 128 nodes; about 5 min wall) through the real agent and aggregator, then
accounts each fault as one interruption on a real-time week (sim/goodput.py; docs/simulator.md
"Goodput"): at the scenario's own rate (Llama 3's) and at the issue's 1 and 2 a day per 1,000
nodes. Budget: ETTR >= 98% with vigil (issue 40). The loss by stage and by cause is in the notes.
Then ``goodput-restart-at-checkpoint`` (a 15%-slow node in a 16-node job that announces its
checkpoints; seconds of wall), with the job-recovery planner on and off: what restarting the job
without the node at its next checkpoint saves over a drain alone, against the oracle.
"""

from __future__ import annotations

from typing import Any

from bench.measure import Measurement
from vigil.sim.goodput import ledger
from vigil.sim.run import run_scenario
from vigil.sim.scenario import load_scenario, parse_scenario

SCENARIO = "week-in-the-life"
# Issue 40's target for vigil's ETTR.
ETTR_BUDGET_PERCENT = 98.0
_ARMS = {"no_vigil": "no vigil", "vigil": "vigil as shipped", "oracle": "oracle"}


def _rows(g: dict[str, Any]) -> list[Measurement]:
    out = []
    for i, rate in enumerate(g["rates"]):
        source = "Llama 3's rate, the scenario's own" if i == 0 else "issue 40's stated rate"
        for arm, a in rate["arms"].items():
            stages = ", ".join(f"{k} {v:,.0f}" for k, v in a["by_stage_gpu_hours"].items()) or "nothing"
            note = f"{a['gpu_hours_lost']:,.0f} GPU-h lost in the week: {stages}"
            if i == 0:
                causes = ", ".join(f"{k} {v:,.0f}" for k, v in list(a["by_cause_gpu_hours"].items())[:6])
                jobs = ", ".join(f"{j} {v['ettr'] * 100:.2f}%" for j, v in a["jobs"].items())
                note += f"; by cause (top 6): {causes}; per job: {jobs}"
            out.append(Measurement(
                f"ETTR, {_ARMS[arm]}, {rate['rate_per_1000_node_days']:g} interruptions/day/1,000 nodes ({source})",
                round(a["ettr"] * 100.0, 2), "%", ETTR_BUDGET_PERCENT if arm == "vigil" else None,
                higher_is_better=True, note=note))
    return out


PLANNER_SCENARIO = "goodput-restart-at-checkpoint"


def _planner() -> list[Measurement]:
    sc = load_scenario(PLANNER_SCENARIO)
    data = sc.model_dump(exclude_defaults=True)
    data["aggregator"] = {"job_recovery": {"enabled": False}}
    out = []
    for label, scenario in (("job_recovery on", sc), ("drain only (job_recovery off)", parse_scenario(data, "off"))):
        arms = ledger(run_scenario(scenario)).to_json()["incidents"][0]["arms"]
        stages = ", ".join(f"{k} {v:,.1f}" for k, v in arms["vigil"]["stages_gpu_hours"].items())
        out.append(Measurement(f"a 15%-slow node's job, GPU-h lost by vigil, {label}", arms["vigil"]["gpu_hours"],
                               "GPU-h", None, note=f"{stages}; oracle {arms['oracle']['gpu_hours']:,.1f}, "
                               f"no vigil {arms['no_vigil']['gpu_hours']:,.1f} ({PLANNER_SCENARIO}: a week of 256 "
                               f"nodes); {arms['vigil']['note']}"))
    return out


def measure() -> list[Measurement]:
    result = run_scenario(load_scenario(SCENARIO))
    return _rows(ledger(result).to_json()) + _planner()


if __name__ == "__main__":
    for m in measure():
        ok = {True: "ok", False: "OVER BUDGET", None: "-"}[m.within_budget]
        print(f"{m.what:80s} {m.value:>8g} {m.unit}  {ok}\n    {m.note}")

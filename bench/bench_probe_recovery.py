"""Time from a fault to verified back in service for a reboot that fixes the node, probes included.

Runs the shipped ``reboot-fixes-probe-passes`` scenario (Xid 79, vigil's reboot, the recovery
detector's passive checks, then the recovery probe set run by the node's simulated agent through
the real prober and outbox; reports every 2.5 s) on the simulated clock, and reads the resume's
time from the fault against the issue's target: the reboot's own time + 90 s. Twice: the nodes
without DCGM (``dcgm_diag`` skipped, the scenario as shipped) and with it (``dcgmi diag -r 2``,
about 2 minutes, sim.scenario DEFAULT_PROBE_SECONDS). It asserts nothing.
"""

from __future__ import annotations

import math
import sys

from bench.measure import Measurement
from vigil.sim.run import run_scenario
from vigil.sim.scenario import SCENARIO_DIR, SimProbes, load_scenario
from vigil.sim.score import score

SCENARIO = "reboot-fixes-probe-passes"
# Issue 39: "simulated time from fault to verified back-in-service for a reboot that fixes the
# node, including the probe (target: reboot + 90 s)".
TARGET_AFTER_REBOOT_SECONDS = 90.0


def _row(dcgm: bool) -> Measurement:
    sc = load_scenario(SCENARIO_DIR / f"{SCENARIO}.yaml")
    # With DCGM the run needs ~2 minutes more than the shipped scenario lasts (its expectation's
    # deadline is for nodes without DCGM, so only the shipped run is scored).
    sc = sc.model_copy(update={"probes": SimProbes(**{**sc.probes.model_dump(), "dcgm_installed": dcgm}),
                               "duration_seconds": sc.duration_seconds + (180 if dcgm else 0)})
    assert sc.remediation is not None
    reboot = sc.remediation.reboot_seconds
    fault = min(f.at_seconds for f in sc.faults if f.kind == "gpu_lost")
    result = run_scenario(sc)
    verdict = "" if dcgm else f"; scenario {'PASS' if score(result).passed else 'FAIL'}"
    resume = next((d for d in result.decisions if d.admitted and d.action == "resume" and d.node == "node-0005"), None)
    runs = [r for r in result.probe_runs if r.node == "node-0005"]
    what = ("fault to verified back in service, reboot fixes the node, probes included"
            + (" (with dcgmi diag -r 2)" if dcgm else ""))
    if resume is None:
        return Measurement(what, math.inf, "s", reboot + TARGET_AFTER_REBOOT_SECONDS,
                           note=f"{SCENARIO}: not resumed{verdict}")
    [back] = [r.back_seconds for r in result.remediations if r.node == "node-0005"]
    run = runs[-1] if runs else None
    probe = "" if run is None else (f"probes ({', '.join(run.probes)}) offered {run.t - back:.1f} s after the boot, "
                                    f"{run.done_seconds - run.t:g} s long; ")
    return Measurement(what, round(resume.t - fault, 1), "s", reboot + TARGET_AFTER_REBOOT_SECONDS,
                       note=(f"{SCENARIO}: reboot {reboot:g} s, back in service {resume.t - back:.1f} s after the "
                             f"boot; {probe.rstrip('; ')}{verdict} "
                             f"({sc.fleet.nodes} nodes, reports every {sc.report_interval_seconds:g} s)"))


def measure() -> list[Measurement]:
    return [_row(dcgm=False), _row(dcgm=True)]


if __name__ == "__main__":
    for m in measure():
        ok = {True: "ok", False: "OVER", None: "-"}[m.within_budget]
        print(f"{m.what:80s} {m.value:>8g} {m.unit} budget {m.budget}  {ok}  {m.note}")
    sys.exit(0)

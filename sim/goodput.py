"""The goodput ledger: how much of the jobs' GPU time went into useful training, per job and fleet.

It reads a scenario's faults, its jobs and the decisions of a run (the real engine and gate's, as
``vigil sim`` records them) and replays each fault as one incident of a synchronous job through
one job-progress model, in three arms: no vigil (the job crashes on NCCL's watchdog, a person
finds the node), vigil as shipped (the run's admitted decisions), and an oracle (the right
decision at the fault's instant). It books each incident's lost GPU time by stage and by cause
and accounts it on the real time the scenario stands for (``goodput.represents_seconds``). It
decides nothing and changes no run: the decisions are the engine's, the arms are analytic.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from vigil.sim.scenario import Goodput, Hang, Job, KernelXid, NvmlFault, PortDown, Reboot, Scenario, Silence, SlowNode

ARMS = ("no_vigil", "vigil", "oracle")
STAGES = ("detection", "gate", "drain", "hold", "restart", "verification", "lost_work", "straggling",
          "false_removal")

# Xids after which the application on the GPU cannot go on (NVIDIA's Xid catalog, "Xid errors":
# 48 double-bit ECC, 74 NVLink, 79 fallen off the bus, 94/95 contained/uncontained ECC, 119/120 GSP):
# its rank dies and the job with it. Other Xids (e.g. 13, 31, 43: the application's own fault) do
# not stop a healthy job in this model.
CRASH_XIDS = frozenset({48, 74, 79, 94, 95, 119, 120})
# NVML faults whose GPU stops serving its rank (the job's interruption, Llama 3 Table 5's GPU rows).
_CRASH_NVML = frozenset({"gpu_lost", "reset_required", "ecc_uncorrectable", "row_remap_failure", "nvlink_down"})
_NODE_REMOVALS = frozenset({"drain", "reset_gpu", "reboot_node", "inspect_hardware"})
_DAY_SECONDS = 86400.0


@dataclass(frozen=True)
class Incident:
    """One fault as a job feels it. ``effect``: crash (the job stops until it restarts without the
    cause), slow (every step ``slowdown`` times as long), none (the job runs on: the fault is
    latent, e.g. corrected ECC errors, a pending row remap)."""

    fault: int  # index in the scenario's faults
    kind: str
    t: float
    node: str | None  # None: the job's own fault (a software hang)
    job: str
    gpus: int  # the job's GPUs
    nodes: int  # the job's nodes
    effect: str
    slowdown: float = 1.0
    persistent: bool = False  # a restart onto the node fails again until it is removed
    until: float | None = None  # the fault ends by itself (None: it stays)
    blocked_after_seconds: float = 0.0  # the others run on this long before they block


@dataclass
class Loss:
    """One arm's loss on one incident, GPU-seconds by stage, and what happened in words."""

    stages: dict[str, float] = field(default_factory=dict)
    note: str = ""

    def add(self, stage: str, gpu_seconds: float) -> None:
        if gpu_seconds > 0:
            self.stages[stage] = self.stages.get(stage, 0.0) + gpu_seconds

    @property
    def total(self) -> float:
        return sum(self.stages.values())


def _job_of(scenario: Scenario, node: str | None) -> Job | None:
    for job in scenario.jobs:
        if node is not None and node in scenario.resolve_nodes(job.nodes):
            return job
    return None


def _slowdown(job: Job, factor: float) -> float:
    """A synchronous step's length relative to a healthy one when one node computes ``factor``
    times as long: its compute is on every step's critical path, data and collective are not."""
    return 1.0 + job.phases.compute * (factor - 1.0)


def incidents(scenario: Scenario) -> list[Incident]:
    """Each fault of the scenario that lands on a job, as that job feels it."""
    from vigil.sim.run import job_impact

    gpn = scenario.fleet.gpus_per_node
    out: list[Incident] = []
    for i, f in enumerate(scenario.faults):
        nodes = scenario.fault_nodes(f)
        if isinstance(f, Hang) and f.node is None and f.nodes is None:
            job = next(j for j in scenario.jobs if j.name == f.job)
            node = None
        else:
            node = f.node if f.node is not None else (nodes[0] if len(nodes) == 1 else None)
            job_or_none = _job_of(scenario, node) if node is not None else None
            if job_or_none is None:  # a switch's, or a node outside every job: no job feels it here
                if f.component is not None:
                    hit = next((j for j in scenario.jobs if set(nodes) & set(scenario.resolve_nodes(j.nodes))), None)
                    if hit is not None:
                        out.append(_incident(i, f, None, hit, scenario, "none"))
                continue
            job = job_or_none
        effect, slowdown, persistent, until, others = "none", 1.0, False, getattr(f, "until_seconds", None), 0.0
        if isinstance(f, SlowNode):
            effect, slowdown = "slow", _slowdown(job, f.factor)
        elif isinstance(f, Hang):
            effect, persistent, others = "crash", node is not None and until is None, f.others_continue_seconds
        elif isinstance(f, KernelXid):
            effect, persistent = ("crash", True) if f.code in CRASH_XIDS else ("none", False)
        elif isinstance(f, NvmlFault):
            code = int((f.model_extra or {}).get("code", 0)) if f.kind == "xid" else 0
            if f.kind in _CRASH_NVML or code in CRASH_XIDS:
                effect, persistent = "crash", True
            else:
                felt = job_impact(f, job.name)
                if isinstance(felt, SlowNode):
                    effect, slowdown, until = "slow", _slowdown(job, felt.factor), felt.until_seconds
        elif isinstance(f, Silence | PortDown | Reboot):
            # The node is down or cut off: its ranks are gone (Llama 3's host and network rows).
            effect = "crash"
            if isinstance(f, PortDown):
                until = None if f.duration_seconds is None else f.at_seconds + f.duration_seconds
            elif isinstance(f, Reboot):
                until = f.at_seconds + f.down_seconds
            persistent = until is None or until > f.at_seconds
        out.append(Incident(i, f.kind, f.at_seconds, node, job.name, len(scenario.resolve_nodes(job.nodes)) * gpn,
                            len(scenario.resolve_nodes(job.nodes)), effect, slowdown, persistent, until, others))
    return out


def _incident(i: int, f: Any, node: str | None, job: Job, scenario: Scenario, effect: str) -> Incident:
    n = len(scenario.resolve_nodes(job.nodes))
    return Incident(i, f.kind, f.at_seconds, node, job.name, n * scenario.fleet.gpus_per_node, n, effect)


@dataclass(frozen=True)
class Horizon:
    """How long a job runs on before it restarts for another reason: interruptions of the job at
    ``rate_per_node_second`` (exponential), within ``window_seconds`` in which the onset is uniform;
    rate 0: until the window's end, from the incident's own time (face value, the run itself)."""

    rate_per_node_second: float
    window_seconds: float
    face_value_end: float | None = None

    def expected_run_on(self, inc: Incident, cap_seconds: float | None = None, *,
                        restarts_remove: bool = True) -> tuple[float, float]:
        """(expected seconds until the node leaves the job: the job restarts for another reason
        (when ``restarts_remove``: the node was drained, so a restart leaves it out), a person
        removes it at ``cap_seconds``, or the window ends; probability that the person came first)."""
        if self.face_value_end is not None:
            left = max(0.0, self.face_value_end - inc.t)
            if cap_seconds is not None and cap_seconds < left:
                return cap_seconds, 1.0
            return left, 0.0
        lam = self.rate_per_node_second * inc.nodes if restarts_remove else 0.0
        w = self.window_seconds
        steps = 200
        total = p_cap = 0.0
        for k in range(steps):
            left = w * (1.0 - (k + 0.5) / steps)  # the onset uniform in the window
            c = left if cap_seconds is None else min(left, cap_seconds)
            total += (1.0 - math.exp(-lam * c)) / lam if lam > 0 else c
            if cap_seconds is not None and cap_seconds < left:
                p_cap += math.exp(-lam * cap_seconds)
        return total / steps, p_cap / steps


class JobProgress:
    """The job-progress model every arm shares: checkpoints at the job's cadence, a restart costs
    the work since the last one plus the job's restart cost."""

    def __init__(self, scenario: Scenario) -> None:
        self.g: Goodput = scenario.goodput
        self._jobs = {j.name: j for j in scenario.jobs}

    def cadence(self, job: str) -> float:
        j = self._jobs[job]
        return j.checkpoint_every_seconds() or self.g.checkpoint_every_seconds

    def since_checkpoint(self, job: str, t: float) -> float:
        """Seconds of work since the job's last checkpoint at ``t`` (checkpoints every cadence
        from the job's start, or from its checkpoint pause's first)."""
        j = self._jobs[job]
        first = j.start_seconds + next((p.first_at_seconds for p in j.pauses if p.kind == "checkpoint"), 0.0)
        return max(0.0, t - first) % self.cadence(job)

    def restart_seconds(self, job: str) -> float:
        r = self._jobs[job].restart_seconds
        return self.g.restart_seconds if r is None else r

    def book_restart(self, loss: Loss, inc: Incident, work_lost_seconds: float, *, removed: bool) -> None:
        loss.add("restart", inc.gpus * self.restart_seconds(inc.job))
        loss.add("lost_work", inc.gpus * work_lost_seconds)
        if removed and not self.g.spare_available:
            loss.add("verification", inc.gpus * self.g.node_return_seconds)


def _relevant(decisions: Sequence[Any], inc: Incident, next_in_job: float) -> list[Any]:
    """The decisions on the incident's node from its onset, and the job-level decisions on its
    job from its onset until the job's next job-level incident (a job-wide hang's)."""
    out = []
    for d in decisions:
        if d.t < inc.t or d.action == "observe":
            continue
        on_node = inc.node is not None and d.node == inc.node and d.component is None
        on_job = d.job == inc.job and d.node is None and d.t < next_in_job
        if on_node or on_job:
            out.append(d)
    return out


def _excludes(d: Any, node: str | None) -> bool:
    exclude = (d.evidence or {}).get("exclude") or ([d.node] if d.node is not None else [])
    return node is not None and node in exclude


def _split(loss: Loss, rate: float, t0: float, end: float, t_first: float | None, t_adm: float | None,
           quiet: str = "detection") -> None:
    """Book ``rate`` GPU-seconds a second over [t0, end): before the first decision as ``quiet``,
    then waiting for the gate, then after vigil acted (a drain keeps no job from running on)."""
    a = min(t_first, end) if t_first is not None else end
    b = min(t_adm, end) if t_adm is not None else end
    loss.add(quiet, rate * (a - t0))
    loss.add("gate", rate * (max(a, b) - a))
    loss.add("drain", rate * (end - max(a, b)))


class Ledger:
    """Every incident of a scenario in the three arms (see the module's docstring)."""

    def __init__(self, scenario: Scenario, decisions: Sequence[Any], *, simulated_seconds: float | None = None,
                 measured_slowdown: dict[int, float] | None = None) -> None:
        """``measured_slowdown``: per fault index, the slow job's step time over its healthy one as
        the run's job model measured it (``ledger`` reads it from the run's job traces); where
        absent, the model's ``1 + compute share x (factor - 1)``."""
        self.scenario = scenario
        self.g = scenario.goodput
        self.progress = JobProgress(scenario)
        self.decisions = sorted(decisions, key=lambda d: d.t)
        measured = measured_slowdown or {}
        self.incidents = [replace(i, slowdown=measured[i.fault]) if i.effect == "slow" and i.fault in measured else i
                          for i in incidents(scenario)]
        self.run_seconds = simulated_seconds if simulated_seconds is not None else scenario.duration_seconds
        self.real = self.g.represents_seconds is not None
        self.window_seconds = self.g.represents_seconds if self.g.represents_seconds is not None else self.run_seconds
        self.fleet_nodes = self.g.represents_nodes or scenario.fleet.nodes
        # The scenario's own interruption rate: each fault one interruption, over the real time and
        # fleet it stands for.
        node_days = self.fleet_nodes * self.window_seconds / _DAY_SECONDS
        self.base_rate_per_1000_node_days = 1000.0 * len(scenario.faults) / node_days if node_days else 0.0

    # -- one incident, one arm ------------------------------------------------------------------

    def _horizon(self, rate_per_1000_node_days: float) -> Horizon:
        if not self.real:
            return Horizon(0.0, self.window_seconds, face_value_end=self.run_seconds)
        return Horizon(rate_per_1000_node_days / 1000.0 / _DAY_SECONDS, self.window_seconds)

    def _next_in_job(self, inc: Incident) -> float:
        return min((o.t for o in self.incidents if o.job == inc.job and o.t > inc.t and o.node is None
                    and o.effect == "crash"), default=math.inf)

    def loss(self, inc: Incident, arm: str, horizon: Horizon) -> Loss:
        if inc.effect == "crash":
            return self._crash(inc, arm)
        if inc.effect == "slow":
            return self._slow(inc, arm, horizon)
        return self._latent(inc, arm)

    def _crash(self, inc: Incident, arm: str) -> Loss:
        g, p, loss = self.g, self.progress, Loss()
        blocked = inc.t + inc.blocked_after_seconds  # the others stop in the collective
        work_lost = p.since_checkpoint(inc.job, blocked)
        crash_at = blocked + g.watchdog_seconds  # NCCL's watchdog aborts the blocked ranks
        self_heals = inc.until if inc.until is not None else math.inf
        if arm == "oracle":
            p.book_restart(loss, inc, p.since_checkpoint(inc.job, inc.t),
                           removed=inc.persistent)
            loss.note = "restarted at the fault's instant without the node, onto a spare"
            return loss
        if arm == "no_vigil":
            up = crash_at
            if inc.persistent and inc.node is not None:
                up = max(crash_at, min(crash_at + g.person_crash_seconds, self_heals))
            loss.add("detection", inc.gpus * (up - blocked))
            p.book_restart(loss, inc, work_lost, removed=inc.persistent and up < self_heals)
            loss.note = (f"blocked until NCCL's watchdog at {crash_at:g} s"
                         + (f", restarts fail on {inc.node} until {up:g} s" if up > crash_at else ""))
            return loss
        rel = _relevant(self.decisions, inc, self._next_in_job(inc))
        t_first = rel[0].t if rel else None
        admitted = [d for d in rel if d.admitted]
        t_adm = admitted[0].t if admitted else None
        restarts = [d for d in admitted if d.action in ("restart_job", "hold_job")
                    or (d.action == "reboot_node" and d.node == inc.node)]
        removal = next((d.t for d in admitted if (d.action in _NODE_REMOVALS and d.node == inc.node)
                        or (d.action == "restart_job" and _excludes(d, inc.node))), None)
        t_r = min(restarts[0].t if restarts else math.inf, crash_at)
        held = bool(restarts) and restarts[0].t <= crash_at and restarts[0].action == "hold_job"
        up = t_r
        if inc.persistent and inc.node is not None and (removal is None or removal > t_r):
            up = max(t_r, min(removal if removal is not None else t_r + g.person_crash_seconds, self_heals))
        start = min(blocked, up)
        _split(loss, inc.gpus, start, up, None if t_first is None else max(t_first, start),
               None if t_adm is None else max(t_adm, start))
        if held:
            loss.add("hold", inc.gpus * g.person_crash_seconds)
        p.book_restart(loss, inc, work_lost, removed=removal is not None and inc.persistent)
        how = ("vigil's " + restarts[0].action + f" at {restarts[0].t:g} s") if restarts and t_r < crash_at \
            else f"NCCL's watchdog at {crash_at:g} s"
        loss.note = (f"first decision {'-' if t_first is None else f'{t_first:g} s'}, job restarted by {how}"
                     + (f", up at {up:g} s" if up > t_r else ""))
        return loss

    def _slow(self, inc: Incident, arm: str, horizon: Horizon) -> Loss:
        g, p, loss = self.g, self.progress, Loss()
        rate = inc.gpus * (1.0 - 1.0 / inc.slowdown)  # GPU-seconds lost per second it runs on the node
        lasts = (inc.until - inc.t) if inc.until is not None else math.inf
        if arm == "oracle":
            run_on, _ = horizon.expected_run_on(inc)
            run_on = min(run_on, lasts)
            since = p.since_checkpoint(inc.job, inc.t)
            options = {
                "never": rate * run_on,
                "now": inc.gpus * (p.restart_seconds(inc.job) + since),
                "checkpoint": rate * min(lasts, p.cadence(inc.job) - since) + inc.gpus * p.restart_seconds(inc.job),
            }
            chosen = min(options, key=lambda k: options[k])
            if chosen == "never":
                loss.add("straggling", options["never"])
            elif chosen == "now":
                p.book_restart(loss, inc, since, removed=True)
            else:
                loss.add("straggling", rate * min(lasts, p.cadence(inc.job) - since))
                p.book_restart(loss, inc, 0.0, removed=True)
            loss.note = f"oracle: restart {chosen} (GPU-s {', '.join(f'{k} {v:,.0f}' for k, v in options.items())})"
            return loss
        if arm == "no_vigil":
            # Nobody knows: a restart for another reason puts the job back on the node.
            run_on, p_found = horizon.expected_run_on(inc, g.person_straggler_seconds, restarts_remove=False)
            loss.add("straggling", rate * min(run_on, lasts))
            self._person_restart(loss, inc, p_found, lasts)
            loss.note = ("never found" if g.person_straggler_seconds is None
                         else f"found by a person after {g.person_straggler_seconds:g} s (p {p_found:.2f})")
            return loss
        rel = _relevant(self.decisions, inc, self._next_in_job(inc))
        t_first = rel[0].t if rel else None
        admitted = [d for d in rel if d.admitted]
        t_adm = next((d.t for d in admitted if d.action in _NODE_REMOVALS or d.action == "restart_job"), None)
        leave = next((d for d in admitted if (d.action == "restart_job" and _excludes(d, inc.node))
                      or (d.action == "reboot_node" and d.node == inc.node)), None)
        if leave is not None:
            end = min(leave.t, inc.t + lasts)
            when = (leave.evidence or {}).get("when")
            _split(loss, rate, inc.t, end, t_first, t_adm)
            if leave.t < inc.t + lasts:
                p.book_restart(loss, inc, 0.0 if when == "checkpoint" else p.since_checkpoint(inc.job, leave.t),
                               removed=True)
            loss.note = f"left the job at vigil's {leave.action} at {leave.t:g} s ({when or 'now'})"
            return loss
        # Not taken out of the job by vigil: drained, it leaves at the job's next restart; the same
        # person as without vigil finds it meanwhile.
        run_on, p_found = horizon.expected_run_on(inc, g.person_straggler_seconds, restarts_remove=t_adm is not None)
        end = inc.t + min(run_on, lasts)
        if t_first is None:
            loss.add("straggling", rate * (end - inc.t))
        else:
            _split(loss, rate, inc.t, end, t_first, t_adm)
        self._person_restart(loss, inc, p_found, lasts)
        loss.note = (f"drained at {t_adm:g} s, the job ran on it until its next restart"
                     if t_adm is not None else "not removed")
        return loss

    def _person_restart(self, loss: Loss, inc: Incident, p_found: float, lasts: float) -> None:
        """A person who found a straggler restarts the job without it (with probability ``p_found``,
        at a moment uniform in the checkpoint interval)."""
        if lasts > (self.g.person_straggler_seconds or math.inf):
            loss.add("restart", p_found * inc.gpus * self.progress.restart_seconds(inc.job))
            loss.add("lost_work", p_found * inc.gpus * self.progress.cadence(inc.job) / 2.0)

    def _latent(self, inc: Incident, arm: str) -> Loss:
        """A fault the running job does not feel: no loss, unless vigil's decision stops the job
        (a reboot of its node, a restart excluding it now); the node leaves at the next restart."""
        loss = Loss(note="the job runs on; the node leaves at its next restart")
        if arm != "vigil" or inc.node is None:
            return loss
        rel = _relevant(self.decisions, inc, self._next_in_job(inc))
        stop = next((d for d in rel if d.admitted and ((d.action == "reboot_node" and d.node == inc.node)
                                                        or (d.action == "restart_job" and _excludes(d, inc.node)))),
                    None)
        if stop is not None:
            when = (stop.evidence or {}).get("when")
            self.progress.book_restart(loss, inc, 0.0 if when == "checkpoint"
                                       else self.progress.since_checkpoint(inc.job, stop.t), removed=True)
            loss.note = f"vigil's {stop.action} at {stop.t:g} s stopped the job"
        return loss

    def false_removals(self) -> list[tuple[Any, Loss, str]]:
        """Admitted decisions that stop a job for a node with no fault of its own (a reboot of it,
        a restart excluding it now): (decision, loss, job). A drain costs the job nothing."""
        out = []
        jobs = {j.name: j for j in self.scenario.jobs}
        gpn = self.scenario.fleet.gpus_per_node
        for d in self.decisions:
            if not d.admitted or d.node is None:
                continue
            own = self.scenario.own_fault_time(d.node)
            if own is not None and d.t >= own:
                continue
            stops = d.action == "reboot_node" or (d.action == "restart_job"
                                                   and (d.evidence or {}).get("when") != "checkpoint")
            job = _job_of(self.scenario, d.node)
            if not stops or job is None:
                continue
            n = len(self.scenario.resolve_nodes(job.nodes))
            inc = Incident(-1, "false_removal", d.t, d.node, job.name, n * gpn, n, "none")
            loss = Loss(note=f"{d.action} of healthy {d.node} at {d.t:g} s")
            loss.add("false_removal", inc.gpus * (self.progress.restart_seconds(job.name)
                                                  + self.progress.since_checkpoint(job.name, d.t)))
            out.append((d, loss, jobs[job.name].name))
        return out

    # -- the figures ----------------------------------------------------------------------------

    def _allocated(self, job: str | None) -> float:
        """GPU-seconds allocated in the accounting window: the job's, or the fleet's (the real
        fleet the scenario stands for, every node in a job like these; else the jobs')."""
        gpn = self.scenario.fleet.gpus_per_node
        if job is not None:
            return len(self.scenario.resolve_nodes(next(j for j in self.scenario.jobs if j.name == job).nodes)) \
                * gpn * self.window_seconds
        if self.real:
            return self.fleet_nodes * gpn * self.window_seconds
        return sum(len(self.scenario.resolve_nodes(j.nodes)) for j in self.scenario.jobs) * gpn * self.window_seconds

    def account(self, rate_per_1000_node_days: float | None = None) -> dict[str, Any]:
        """Per arm: ETTR, GPU-hours lost, by stage and by cause, fleet and per job, at ``rate``
        (interruptions a day per 1,000 nodes; None: the scenario's own). Each incident stands for
        ``rate / base rate`` real ones (at real rates they do not overlap)."""
        base = self.base_rate_per_1000_node_days
        rate = base if rate_per_1000_node_days is None else rate_per_1000_node_days
        scale = rate / base if base > 0 and self.real else 1.0
        horizon = self._horizon(rate)
        per_job_incidents = {j.name: sum(1 for i in self.incidents if i.job == j.name) for j in self.scenario.jobs}
        arms: dict[str, Any] = {}
        for arm in ARMS:
            by_stage: dict[str, float] = dict.fromkeys(STAGES, 0.0)
            by_cause: dict[str, float] = {}
            by_job: dict[str, dict[str, float]] = {j.name: dict.fromkeys(STAGES, 0.0) for j in self.scenario.jobs}
            entries = [(inc.kind, inc.job, self.loss(inc, arm, horizon)) for inc in self.incidents]
            if arm == "vigil":
                entries += [("false_removal", job, loss) for _, loss, job in self.false_removals()]
            for cause, job, loss in entries:
                for stage, v in loss.stages.items():
                    by_stage[stage] += v * scale
                    by_job[job][stage] += v
                    by_cause[cause] = by_cause.get(cause, 0.0) + v * scale
            lost = sum(by_stage.values())
            jobs_out = {}
            for j in self.scenario.jobs:
                j_lost = sum(by_job[j.name].values())
                if self.real and per_job_incidents[j.name]:
                    # The job's own share of the real rate: its nodes' interruptions in the window.
                    expected = rate / 1000.0 * len(self.scenario.resolve_nodes(j.nodes)) \
                        * self.window_seconds / _DAY_SECONDS
                    j_lost *= expected / per_job_incidents[j.name]
                jobs_out[j.name] = {"ettr": round(1.0 - j_lost / self._allocated(j.name), 5),
                                    "gpu_hours_lost": round(j_lost / 3600.0, 1)}
            arms[arm] = {
                "ettr": round(1.0 - lost / self._allocated(None), 5),
                "gpu_hours_lost": round(lost / 3600.0, 1),
                "by_stage_gpu_hours": {k: round(v / 3600.0, 1) for k, v in by_stage.items() if v > 0},
                "by_cause_gpu_hours": {k: round(v / 3600.0, 1)
                                       for k, v in sorted(by_cause.items(), key=lambda kv: -kv[1])},
                "jobs": jobs_out,
            }
        return {"rate_per_1000_node_days": round(rate, 2), "arms": arms}

    def to_json(self) -> dict[str, Any]:
        g = self.g
        rates = [self.account()]
        if self.real:
            rates += [self.account(r) for r in g.rates_per_1000_node_days]
        horizon = self._horizon(self.base_rate_per_1000_node_days)
        return {
            "accounting": ("real time: each fault one interruption of a "
                           f"{self.fleet_nodes}-node fleet over {self.window_seconds / _DAY_SECONDS:g} days")
            if self.real else "face value: the simulated run itself",
            "window_seconds": self.window_seconds,
            "fleet_nodes": self.fleet_nodes,
            "assumptions": {"checkpoint_every_seconds": g.checkpoint_every_seconds,
                            "restart_seconds": g.restart_seconds, "watchdog_seconds": g.watchdog_seconds,
                            "person_crash_seconds": g.person_crash_seconds,
                            "person_straggler_seconds": g.person_straggler_seconds,
                            "spare_available": g.spare_available},
            "rates": rates,
            "incidents": [
                {"fault": inc.fault, "kind": inc.kind, "t": inc.t, "node": inc.node, "job": inc.job,
                 "effect": inc.effect,
                 "arms": {arm: {"gpu_hours": round((loss := self.loss(inc, arm, horizon)).total / 3600.0, 2),
                                "stages_gpu_hours": {k: round(v / 3600.0, 2) for k, v in loss.stages.items()},
                                "note": loss.note} for arm in ARMS}}
                for inc in self.incidents],
            "false_removals": [{"t": d.t, "node": d.node, "action": d.action,
                                "gpu_hours": round(loss.total / 3600.0, 2)} for d, loss, _ in self.false_removals()],
        }


def ledger(result: Any) -> Ledger:
    """The ledger of a finished run (sim.run.SimResult), each straggler's slowdown as its job ran."""
    return Ledger(result.scenario, result.decisions, simulated_seconds=result.simulated_seconds,
                  measured_slowdown=measured_slowdowns(result.scenario, result.jobs))


# The windows a slowdown is measured on: the job's steps in the 300 s before the fault against
# those from 30 s after it (the first windows straddle the onset) for up to 300 s, or until the
# fault or the next fault of the job.
_BEFORE_SECONDS = 300.0
_SETTLE_SECONDS = 30.0
_AFTER_SECONDS = 300.0


def measured_slowdowns(scenario: Scenario, traces: Sequence[Any]) -> dict[int, float]:
    """Per slow fault the live job model feels (a slow node; a throttle where hardware reaches the
    jobs), its job's median step time after the onset over its median before, from the run's
    job traces (sim.run.JobTrace); faults without a clean window on either side are left out."""
    import numpy as np

    by_job = {t.name: t for t in traces}
    faults = scenario.faults
    out: dict[int, float] = {}
    for inc in incidents(scenario):
        f = faults[inc.fault]
        if inc.effect != "slow" or not (isinstance(f, SlowNode) or scenario.hardware_disrupts_jobs):
            continue
        trace = by_job.get(inc.job)
        if trace is None or not trace.t:
            continue
        # The other faults the live job feels (hardware only where it reaches the jobs).
        others = [o.t for o in incidents(scenario) if o.job == inc.job and o.effect in ("slow", "crash")
                  and (isinstance(faults[o.fault], SlowNode | Hang) or scenario.hardware_disrupts_jobs)]
        prev = max((t for t in others if t < inc.t), default=-math.inf)
        nxt = min([t for t in others if t > inc.t] + [inc.until if inc.until is not None else math.inf])
        t = np.asarray(trace.t)
        step = np.asarray(trace.step_seconds)
        before = step[(t > max(prev, inc.t - _BEFORE_SECONDS)) & (t <= inc.t)]
        after = step[(t > inc.t + _SETTLE_SECONDS) & (t <= min(nxt, inc.t + _SETTLE_SECONDS + _AFTER_SECONDS))]
        if len(before) >= 3 and len(after) >= 3:
            out[inc.fault] = max(1.0, float(np.median(after) / np.median(before)))
    return out

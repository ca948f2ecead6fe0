"""Configuration drift detector: a node configured unlike its job's peers, or unlike its site manifest.

It reads each node's configuration facts (``wire.NodeConfig``), the fleet's job membership and the
site manifest per GPU model. The few nodes off a job's majority value are each that node's drift (per
node, default alert), a large split or fleet-wide roll-out is one job-level alert naming the mix, and a
node short of its manifest is a per-node finding; it judges no GPU or link health. Which facts are
compared where, thresholds, persistence and lookalikes: docs/detectors.md, "fabric, pcie_link,
config_drift".
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any, Literal, NamedTuple

import msgspec
from pydantic import Field, field_validator

from vigil.aggregator.decision import WHOLE_JOB, Action, Finding, NodeAction
from vigil.aggregator.fleet import FleetView, JobState, NodeState
from vigil.contract.validation import StrictModel
from vigil.contract.wire import NodeConfig

NAME = "config_drift"

# Every fact of NodeConfig but ``mixed`` (which names facts, judged on its own).
NODE_CONFIG_FACTS = tuple(f.name for f in msgspec.structs.fields(NodeConfig) if f.name != "mixed")
# The facts a job's nodes share whatever their hardware: the host's software stack (kernel, the
# RDMA stack). The GPU driver's facts and the GPU modes a site sets are shared by a job's nodes of
# one vendor (the cluster guide: one driver for every GPU of a job; an NVIDIA node's driver 550 and
# an AMD node's amdgpu 6.8 are both right, issue 46): compared among the job's nodes of one vendor.
# The other facts belong to the hardware class (VBIOS, firmware, clocks, power limit, GPU and HCA
# counts and models differ between an H100 and an H200 node by design): they are compared only
# among the job's nodes of one GPU model, and the GPU model itself never is (a mixed job is a class
# difference, not drift).
VENDOR_WIDE_FACTS = frozenset({"driver_version", "cuda_driver_version", "ecc_mode", "persistence_mode", "mig_mode"})
JOB_WIDE_FACTS = frozenset({"kernel", "ofed_version", "rdma_core_version"}) | VENDOR_WIDE_FACTS


class ManifestClass(StrictModel):
    """What every node of one hardware class (GPU model) must have; None: not checked."""

    gpu_count: int | None = Field(default=None, ge=0)
    hca_count: int | None = Field(default=None, ge=0)
    # The first active HCA port's rate (NodeConfig.hca_link_rate_bits_per_second): NDR is 400e9.
    hca_link_rate_bits_per_second: float | None = Field(default=None, gt=0)
    # Each GPU's maximum PCIe link (NVML's, the GPU and its slot together): H100/H200 SXM Gen5 x16.
    gpu_pcie_generation: int | None = Field(default=None, ge=1, le=8)
    gpu_pcie_width: int | None = Field(default=None, ge=1, le=32)
    # The driver versions allowed on this class; empty: any.
    driver_versions: list[str] = []


class ConfigDriftConfig(StrictModel):
    """A node configured unlike its job's peers (drift), a job split by a roll-out (one alert with the mix), and
    a node short of the site manifest (``manifest``, per GPU model; docs/detectors.md)."""
    enabled: bool = True
    # The facts compared across a job's nodes (NodeConfig's fields).
    facts: list[str] = list(NODE_CONFIG_FACTS)
    # A value off a job's majority for a fact is its nodes' drift when it is on one node or on at
    # most this share of the job's nodes that report the fact; more is a roll-out in progress (the
    # cluster guide's "no configuration drift" is about the odd node; a staged upgrade splits a job
    # in two large parts), alerted once per job with the mix.
    minority_max_share: float = Field(default=0.2, gt=0, lt=0.5)
    # Fewer nodes than this in a job: no majority to judge a node against (2 nodes that differ
    # are a mix, not one node's drift).
    min_job_nodes: int = Field(default=3, ge=3)
    # A value held by at least two nodes and this share of the fleet's nodes of the same GPU model
    # that report the fact is a roll-out's, not one node's drift, wherever it sits in a job.
    fleet_rollout_min_share: float = Field(default=0.1, gt=0, le=1)
    # A job none of whose ranks reported for this long is over: its nodes are not compared.
    job_idle_seconds: float = Field(default=60.0, gt=0)
    # A difference must hold this long before it is a finding: a rolling upgrade passes through a
    # node in minutes (reboot, new driver, report); a node left behind stays.
    persistence_seconds: float = Field(default=600.0, ge=0)
    # Per-node drift: alert by default. ``drain`` keeps the node out of new multi-node jobs
    # (a Slurm drain lets the running job finish; Kubernetes cordons): the gate's breaker still
    # bounds how many nodes go at once.
    action: NodeAction = Action.ALERT
    # The per-job mix (a roll-out in progress): a job-level decision, never a removal nor a restart.
    mix_action: Literal[Action.OBSERVE, Action.ALERT] = Action.ALERT
    # Facts the node's own GPUs or HCAs disagree on (NodeConfig.mixed).
    mixed_action: NodeAction = Action.ALERT
    # The site manifest, per GPU model (NodeConfig.gpu_model, e.g. "NVIDIA H100 80GB HBM3").
    manifest: dict[str, ManifestClass] = {}
    # A node short of its manifest (a GPU or HCA missing, a slow link, a driver not allowed):
    # hardware or set-up the node cannot run a job right with; drained by default.
    manifest_action: NodeAction = Action.DRAIN
    manifest_persistence_seconds: float = Field(default=60.0, ge=0)

    @field_validator("facts")
    @classmethod
    def _known_facts(cls, facts: list[str]) -> list[str]:
        unknown = sorted(set(facts) - set(NODE_CONFIG_FACTS))
        if unknown:
            raise ValueError(f"unknown fact(s) {unknown}: the facts are {list(NODE_CONFIG_FACTS)}")
        return facts


class _JobVerdict(msgspec.Struct, frozen=True):
    """One job's comparison: per drifted node, its (fact, value, peers' value) list; the facts split
    too widely to blame a node, with their value counts."""

    drift: dict[str, list[tuple[str, Any, Any]]]
    mix: dict[str, list[tuple[Any, int]]]
    nodes: int


class _HeldJob(NamedTuple):
    """A job's verdict and what it was read from: the JobState, its membership, its member nodes,
    the newest configuration change among them, and the fleet's configuration revision then."""

    job: JobState
    members_revision: int
    members: tuple[str, ...]
    members_config_revision: int
    config_revision: int
    verdict: _JobVerdict


def _members_config_revision(view: FleetView, members: tuple[str, ...]) -> int:
    nodes = view.nodes
    return max((nodes[n].config_revision for n in members if n in nodes), default=0)


class ConfigDriftDetector:
    name = NAME

    def __init__(self, config: ConfigDriftConfig) -> None:
        self.config = config
        self._facts = tuple(config.facts)
        self._fleet: object | None = None
        # Per job: its verdict and what it was read from.
        self._jobs: dict[str, _HeldJob] = {}
        # The fleet's value counts per (GPU model, fact), kept up to date from each node's
        # configuration as counted (node name -> NodeConfig: a change replaces the object), as of
        # the fleet's config_revision ``_counted_revision``.
        self._counts: dict[tuple[str | None, str], Counter[Any]] = {}
        self._counted: dict[str, NodeConfig] = {}
        self._counted_revision: int | None = None
        # Per node: (the NodeState, its config_revision, gpu_faults_revision) -> its manifest shortfalls.
        self._manifest: dict[str, tuple[NodeState, int, int, list[str]]] = {}
        # When each episode was first found (the persistence clock and a stable ``since``).
        self._first: dict[tuple[str, str], float] = {}
        # The nodes judged on their own (``_own_judged``), as of the fleet's config_revision.
        self._own: list[NodeState] = []
        self._own_revision: int | None = None

    def evaluate(self, view: FleetView, now: float) -> list[Finding]:
        # Caches hold for one fleet and views with change markers (docs/detectors.md, "change
        # markers"); a view without them is judged from scratch and leaves nothing behind.
        marked = view.revision is not None
        if not marked or view.fleet is not self._fleet:
            self._jobs.clear()
            self._manifest.clear()
            self._counts, self._counted, self._counted_revision = {}, {}, None
            self._own, self._own_revision = [], None
            self._fleet = view.fleet if marked else None
        candidates: dict[tuple[str, str], tuple[Finding, float]] = {}
        drift: dict[str, list[dict[str, Any]]] = {}
        cfg = self.config
        for job in view.jobs.values():
            if now - job.last_seen > cfg.job_idle_seconds:
                continue  # ended (its ranks no longer report): its nodes are no longer each other's peers
            verdict = self._verdict(view, job, marked)
            for node_name, odd in verdict.drift.items():
                drift.setdefault(node_name, []).extend(
                    {"fact": fact, "value": value, "peers": peers, "job": job.name, "job_nodes": verdict.nodes}
                    for fact, value, peers in odd)
            if verdict.mix:
                self._mix(job, verdict, candidates)
        for node_name, facts in drift.items():
            text = "; ".join(f"{f['fact']} {f['value']} where its job {f['job']}'s other nodes have {f['peers']}"
                             for f in facts)
            candidates[(node_name, "config_drift")] = (Finding(
                detector=NAME, node=node_name, action=cfg.action, key="config_drift", since=0.0,
                reason=f"configuration drift: {text}", evidence={"signal": "config_drift", "facts": facts}),
                cfg.persistence_seconds)
        for node in self._own_judged(view, marked):
            config = node.config
            if config is None:
                continue
            if config.mixed:
                candidates[(node.name, "config_mixed")] = (Finding(
                    detector=NAME, node=node.name, action=cfg.mixed_action, key="config_mixed", since=0.0,
                    reason=f"the node's own devices differ in {', '.join(config.mixed)}",
                    evidence={"signal": "config_mixed", "facts": list(config.mixed)}), cfg.persistence_seconds)
            if cfg.manifest:
                short = self._shortfalls(node, config, marked)
                if short:
                    candidates[(node.name, "manifest")] = (Finding(
                        detector=NAME, node=node.name, action=cfg.manifest_action, key="manifest", since=0.0,
                        reason=f"not as the site manifest for {config.gpu_model}: {'; '.join(short)}",
                        evidence={"signal": "manifest", "gpu_model": config.gpu_model, "shortfalls": short}),
                        cfg.manifest_persistence_seconds)
        first = {key: self._first.get(key, now) for key in candidates}
        self._first = first
        out = [f.model_copy(update={"since": first[key]}) for key, (f, hold) in candidates.items()
               if now - first[key] >= hold]
        if len(self._jobs) > len(view.jobs):
            self._jobs = {n: v for n, v in self._jobs.items() if n in view.jobs}
        if len(self._manifest) > len(view.nodes):
            self._manifest = {n: v for n, v in self._manifest.items() if n in view.nodes}
        return out

    def _own_judged(self, view: FleetView, marked: bool) -> list[NodeState]:
        """The nodes with something to judge on their own, in the fleet's order: a configuration whose
        devices differ (``mixed``) or whose GPU model the manifest names. Listed again only when a
        node's configuration changed or a node joined or left (the fleet's config_revision): a walk
        of 12,500 nodes costs 6 ms a pass (issue 47)."""
        if marked and self._own_revision == view.config_revision:
            return self._own
        manifest = self.config.manifest
        own = [node for node in view.nodes.values() if (config := node.config) is not None
               and (config.mixed or (manifest and (config.gpu_model or "") in manifest))]
        if marked:
            self._own, self._own_revision = own, view.config_revision
        return own

    def _mix(self, job: JobState, verdict: _JobVerdict,
             candidates: dict[tuple[str, str], tuple[Finding, float]]) -> None:
        """The one job-level finding naming a split too wide to blame a node (a roll-out)."""
        parts = [f"{fact} " + ", ".join(f"{value} on {count} node{'s' if count != 1 else ''}"
                                        for value, count in counts)
                 for fact, counts in sorted(verdict.mix.items())]
        candidates[("job:" + job.name, "config_mix")] = (Finding(
            detector=NAME, node=WHOLE_JOB, job=job.name, action=self.config.mix_action, key="config_mix", since=0.0,
            reason=f"job {job.name} runs on mixed configurations (a roll-out in progress?): {'; '.join(parts)}",
            evidence={"signal": "config_mix", "job_nodes": verdict.nodes,
                      "mix": {fact: [[value, count] for value, count in counts]
                              for fact, counts in sorted(verdict.mix.items())}}), self.config.persistence_seconds)

    def _verdict(self, view: FleetView, job: JobState, marked: bool) -> _JobVerdict:
        """The job's comparison, read again only when its membership or a member's configuration
        changed, or, for a job whose nodes differ at all, when any node's did (the fleet's value
        counts decide between a node's drift and a roll-out)."""
        held = self._jobs.get(job.name)
        if marked and held is not None and held.job is job and held.members_revision == job.members_revision:
            if held.config_revision == view.config_revision:
                return held.verdict
            if not held.verdict.drift and not held.verdict.mix \
                    and _members_config_revision(view, held.members) == held.members_config_revision:
                self._jobs[job.name] = held._replace(config_revision=view.config_revision)
                return held.verdict
        members = tuple(n for n in sorted(job.nodes()) if n in view.nodes)
        configs = [(n, c) for n in members if (c := view.nodes[n].config) is not None]
        # A job on one node (or one with a configuration) has no peers: held too, as nothing to say.
        verdict = self._compare(view, configs, marked) if len(configs) >= 2 else _JobVerdict({}, {}, len(configs))
        if marked:
            self._jobs[job.name] = _HeldJob(job, job.members_revision, members,
                                            _members_config_revision(view, members), view.config_revision, verdict)
        return verdict

    def _compare(self, view: FleetView, configs: list[tuple[str, NodeConfig]], marked: bool) -> _JobVerdict:
        drift: dict[str, list[tuple[str, Any, Any]]] = {}
        mix: dict[str, list[tuple[Any, int]]] = {}
        by_model: dict[str | None, list[tuple[str, NodeConfig]]] = {}
        by_vendor: dict[str, list[tuple[str, NodeConfig]]] = {}
        for name, c in configs:
            by_model.setdefault(c.gpu_model, []).append((name, c))
            by_vendor.setdefault(_vendor(view.nodes[name]), []).append((name, c))
        for fact in self._facts:
            if fact == "gpu_model":
                continue
            if fact in VENDOR_WIDE_FACTS and len(by_vendor) > 1:
                groups: dict[Any, list[tuple[str, NodeConfig]]] = dict(by_vendor)
            elif fact in JOB_WIDE_FACTS or len(by_model) == 1:
                self._compare_fact(view, fact, fact, configs, marked, drift, mix)
                continue
            else:
                groups = dict(by_model)
            for group_name, group in sorted(groups.items(), key=lambda kv: str(kv[0])):
                self._compare_fact(view, fact, f"{fact} ({group_name})", group, marked, drift, mix)
        return _JobVerdict(drift, mix, len(configs))

    def _compare_fact(self, view: FleetView, fact: str, label: str, configs: list[tuple[str, NodeConfig]],
                      marked: bool, drift: dict[str, list[tuple[str, Any, Any]]],
                      mix: dict[str, list[tuple[Any, int]]]) -> None:
        """One fact over one set of a job's nodes: each node's drift, or the set's mix (as ``label``)."""
        cfg = self.config
        values = [(name, getattr(c, fact), c.gpu_model) for name, c in configs]
        known = [(name, v, model) for name, v, model in values if v is not None]
        counts = Counter(v for _, v, _ in known)
        if len(counts) <= 1:
            return
        ranked = counts.most_common()
        majority, top = ranked[0]
        # Each value off the majority is its nodes' drift when it is on one node or a small
        # share of the job and rare in the fleet; any other (a tie, a large group, a roll-out's
        # value) makes the fact the job's mix, and then no node is blamed for it here.
        blamable = top > ranked[1][1] and len(known) >= cfg.min_job_nodes
        if blamable:
            fleet = self._fleet_values(view, marked)
            models = {v: model for _, v, model in known}
            blamable = all((count == 1 or count / len(known) <= cfg.minority_max_share)
                           and not _rollout(fleet.get((models[value], fact)), value, cfg.fleet_rollout_min_share)
                           for value, count in ranked[1:])
        if blamable:
            for name, v, _ in known:
                if v != majority:
                    drift.setdefault(name, []).append((fact, v, majority))
        else:
            mix[label] = sorted(counts.items(), key=lambda kv: (-kv[1], str(kv[0])))

    def _fleet_values(self, view: FleetView, marked: bool) -> dict[tuple[str | None, str], Counter[Any]]:
        """Each (GPU model, fact)'s values across the fleet: brought up to date when a configuration
        changed, by the nodes whose configuration object is not the one counted (and those gone)."""
        if not marked:
            self._counts, self._counted, self._counted_revision = {}, {}, None
        elif self._counted_revision == view.config_revision:
            return self._counts
        counted, nodes = self._counted, view.nodes
        for node in nodes.values():
            config, was = node.config, counted.get(node.name)
            if config is not was:
                self._count(was, -1)
                self._count(config, 1)
                if config is None:
                    counted.pop(node.name, None)
                else:
                    counted[node.name] = config
        for name in [n for n in counted if n not in nodes]:  # forgotten
            self._count(counted.pop(name), -1)
        self._counted_revision = view.config_revision
        return self._counts

    def _count(self, config: NodeConfig | None, by: int) -> None:
        if config is None:
            return
        counts = self._counts
        for fact in self._facts:
            value = getattr(config, fact)
            if value is not None:
                tally = counts.setdefault((config.gpu_model, fact), Counter())
                tally[value] += by
                if not tally[value]:
                    del tally[value]

    def _shortfalls(self, node: NodeState, config: NodeConfig, marked: bool) -> list[str]:
        """How the node falls short of its class's manifest (none where its model has no entry)."""
        expected = self.config.manifest.get(config.gpu_model or "")
        if expected is None:
            return []
        held = self._manifest.get(node.name)
        if marked and held is not None and held[0] is node and held[1] == node.config_revision \
                and held[2] == node.gpu_faults_revision:
            return held[3]
        short: list[str] = []
        for fact, want in (("gpu_count", expected.gpu_count), ("hca_count", expected.hca_count),
                           ("hca_link_rate_bits_per_second", expected.hca_link_rate_bits_per_second)):
            have = getattr(config, fact)
            if want is not None and have is not None and have != want:
                short.append(f"{fact} {have:g} (expected {want:g})")
        if expected.driver_versions and config.driver_version is not None \
                and config.driver_version not in expected.driver_versions:
            short.append(f"driver {config.driver_version} (allowed: {', '.join(expected.driver_versions)})")
        short.extend(_gpu_links(node.gpus.values(), expected))
        if marked:
            self._manifest[node.name] = (node, node.config_revision, node.gpu_faults_revision, short)
        return short


def _vendor(node: NodeState) -> str:
    """The vendor of the node's GPUs (GpuState.vendor, the most common); "nvidia" where none says (an
    agent from before issue 46 reads NVML only, and a node that reports no GPU has no driver to compare
    against another vendor's)."""
    vendors = Counter(g.last.vendor for g in node.gpus.values() if g.last.vendor is not None)
    return vendors.most_common(1)[0][0] if vendors else "nvidia"


def _gpu_links(gpus: Iterable[Any], expected: ManifestClass) -> list[str]:
    out = []
    for gpu in sorted(gpus, key=lambda g: g.index):
        s = gpu.last
        gen, width = s.pcie_link_generation_max, s.pcie_link_width_max
        if (expected.gpu_pcie_generation is not None and gen is not None and gen < expected.gpu_pcie_generation) \
                or (expected.gpu_pcie_width is not None and width is not None and width < expected.gpu_pcie_width):
            out.append(f"GPU {gpu.index} PCIe max Gen{gen} x{width} (expected Gen{expected.gpu_pcie_generation} "
                       f"x{expected.gpu_pcie_width})")
    return out


def _rollout(counts: Counter[Any] | None, value: Any, min_share: float) -> bool:
    """Whether ``value`` is held by enough of the fleet to be a roll-out's, not one node's drift."""
    if counts is None:
        return False
    held = counts.get(value, 0)
    return held >= 2 and held / sum(counts.values()) >= min_share

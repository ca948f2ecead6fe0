"""Builds vigil's Grafana dashboards (fleet overview, node drill-down, job view) as JSON.

Run ``python -m dashboards.build`` after editing; the JSON files beside this script are its output
and a test checks they are in step. Plain data, no Grafana library: each panel is a title, a
unit and PromQL over the metrics the agent and aggregator declare (a test checks every name and
parses every expression with promtool). It does not talk to a Grafana server.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OUT_DIR = Path(__file__).resolve().parent
DS = {"type": "prometheus", "uid": "${datasource}"}
AGENT = 'job=~"vigil-agent.*"'
WIDTH = 24  # Grafana's grid is 24 columns wide


@dataclass
class Target:
    expr: str
    legend: str = ""
    instant: bool = False


@dataclass
class Panel:
    title: str
    targets: list[Target]
    kind: str = "timeseries"
    unit: str = "short"
    width: int = 12
    height: int = 8
    description: str = ""
    options: dict[str, Any] = field(default_factory=dict)
    defaults: dict[str, Any] = field(default_factory=dict)


@dataclass
class Row:
    title: str


def _datasource_var() -> dict[str, Any]:
    return {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
            "current": {}, "hide": 0, "refresh": 1, "regex": "", "options": []}


def _query_var(name: str, label: str, query: str, *, multi: bool = False) -> dict[str, Any]:
    var: dict[str, Any] = {
        "name": name, "label": label, "type": "query", "datasource": DS,
        "query": {"query": query, "refId": f"{name}-var"}, "definition": query,
        "refresh": 2, "sort": 3 if name == "gpu" else 1, "hide": 0, "current": {}, "options": [],
        "multi": multi, "includeAll": multi,
    }
    if multi:
        var["allValue"] = ".*"
    return var


def _panel_json(panel: Panel, panel_id: int, x: int, y: int) -> dict[str, Any]:
    targets = []
    for i, t in enumerate(panel.targets):
        target: dict[str, Any] = {"refId": chr(ord("A") + i), "datasource": DS, "expr": t.expr,
                                  "legendFormat": t.legend or "__auto", "range": not t.instant,
                                  "instant": t.instant}
        if panel.kind == "table":
            target["format"] = "table"
        targets.append(target)
    defaults: dict[str, Any] = {"unit": panel.unit, **panel.defaults}
    out: dict[str, Any] = {
        "id": panel_id, "type": panel.kind, "title": panel.title, "datasource": DS,
        "gridPos": {"h": panel.height, "w": panel.width, "x": x, "y": y},
        "targets": targets, "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": panel.options,
    }
    if panel.description:
        out["description"] = panel.description
    return out


def dashboard(uid: str, title: str, description: str, variables: list[dict[str, Any]],
              items: list[Panel | Row]) -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    x = y = 0
    row_height = 0
    for panel_id, item in enumerate(items, start=1):
        if isinstance(item, Row):
            y += row_height
            x, row_height = 0, 0
            panels.append({"id": panel_id, "type": "row", "title": item.title, "collapsed": False,
                           "gridPos": {"h": 1, "w": WIDTH, "x": 0, "y": y}, "panels": []})
            y += 1
            continue
        if x + item.width > WIDTH:
            y += row_height
            x, row_height = 0, 0
        panels.append(_panel_json(item, panel_id, x, y))
        x += item.width
        row_height = max(row_height, item.height)
    return {
        "uid": uid, "title": title, "description": description, "tags": ["vigil"],
        "editable": True, "graphTooltip": 1, "schemaVersion": 39, "version": 1,
        "time": {"from": "now-6h", "to": "now"}, "refresh": "30s", "timezone": "browser",
        "annotations": {"list": []},
        "templating": {"list": [_datasource_var(), *variables]},
        "links": [{"title": "vigil dashboards", "type": "dashboards", "tags": ["vigil"], "asDropdown": True,
                   "includeVars": True, "keepTime": True}],
        "panels": panels,
    }


def _table(title: str, expr: str, width: int = 12, unit: str = "short", description: str = "") -> Panel:
    return Panel(title, [Target(expr, instant=True)], kind="table", unit=unit, width=width, description=description)


def _xids_by_source(sel: str, window: str) -> str:
    """Xids per GPU and code in ``window`` from both sources, told apart by a ``source`` label. The
    agent starts the paged codes' counters at 0, so increase() sees their first Xid."""
    return " or ".join(
        f'label_replace(increase({metric}{{{sel}}}[{window}]), "source", "{source}", "", "")'
        for metric, source in (("vigil_gpu_xid_errors_total", "kmsg"), ("vigil_gpu_nvml_xid_events_total", "nvml")))


def _xids_per_gpu(sel: str, window: str) -> str:
    """Xids per GPU in ``window``: the larger of the two sources' counts (they see the same faults)."""
    return f"max by (node, gpu, uuid) (sum by (node, gpu, uuid, source) ({_xids_by_source(sel, window)}))"


# A link trained below its maximum generation or width: a GPU's (NVML) and an HCA's (sysfs).
GPU_LINK_BELOW = ("(vigil_gpu_pcie_link_width < vigil_gpu_pcie_link_width_max) or "
                  "(vigil_gpu_pcie_link_generation < vigil_gpu_pcie_link_generation_max)")
HCA_LINK_BELOW = ('(vigil_pcie_link_width{kind="hca"} < vigil_pcie_link_width_max{kind="hca"}) or '
                  '(vigil_pcie_link_generation{kind="hca"} < vigil_pcie_link_generation_max{kind="hca"})')


def _precision_panels() -> list[Panel | Row]:
    """Precision from outcomes (docs/precision.md): each rule's posterior with its interval and target,
    its labelled removals, and which rules are demoted to alert."""
    return [
        Row("Detector precision from outcomes"),
        Panel("Precision per rule (posterior mean, credible interval, target)",
              [Target("vigil_detector_precision", "{{detector}}/{{rule}}"),
               Target("vigil_detector_precision_lower", "{{detector}}/{{rule}} lower"),
               Target("vigil_detector_precision_upper", "{{detector}}/{{rule}} upper"),
               Target("vigil_detector_precision_target", "{{detector}}/{{rule}} target")],
              unit="percentunit", width=12,
              description="From each rule's removals labelled by what happened next (a probe failed, a repair, "
                          "the fault came back: confirmed; probes passed, clean under load, a no-fault ticket: not)."),
        _table("Rules: precision, interval, removals labelled, demoted",
               'max by (detector, rule) (vigil_detector_precision) or max by (detector, rule) '
               '(vigil_detector_precision_lower) or max by (detector, rule) (vigil_detector_precision_upper) or '
               'sum by (detector, rule, label) (vigil_detector_outcomes_total) or max by (detector, rule) '
               '(vigil_detector_demoted)',
               description="A demoted rule (vigil_detector_demoted 1) proposes alerts where it would remove a "
                           "node, until its posterior recovers or an operator promotes it."),
        Panel("Rules demoted to alert", [Target("sum(vigil_detector_demoted) or vector(0)", instant=True)],
              kind="stat", width=6, height=5,
              defaults={"thresholds": {"mode": "absolute", "steps": [
                  {"color": "green", "value": None}, {"color": "red", "value": 1}]}}),
    ]


def fleet() -> dict[str, Any]:
    items: list[Panel | Row] = [
        Row("Fleet"),
        Panel("Agents up", [Target(f"count(up{{{AGENT}}} == 1)", instant=True)], kind="stat", width=4, height=5),
        Panel("Agents down", [Target(f"count(up{{{AGENT}}} == 0) or vector(0)", instant=True)], kind="stat",
              width=4, height=5, defaults={"thresholds": {"mode": "absolute", "steps": [
                  {"color": "green", "value": None}, {"color": "red", "value": 1}]}}),
        Panel("Nodes by aggregator state", [Target("sum by (state) (vigil_aggregator_nodes)", "{{state}}")],
              width=8, height=5, description="The aggregator's verdict per node: ok, suspect, failing, silent.",
              options={"stacking": {"mode": "normal"}}),
        Panel("Firing vigil alerts", [Target('count by (severity) (ALERTS{alertstate="firing", alertname=~"Vigil.*"})',
                                             "{{severity}}")], width=8, height=5),
        Row("Decisions"),
        Panel("Decisions by action", [Target(
            "sum by (action) (increase(vigil_aggregator_decisions_total[$__rate_interval]))", "{{action}}")],
            width=12, description="Verdicts the aggregator recorded, by the action as admitted."),
        Panel("Decisions by detector", [Target(
            "sum by (detector) (increase(vigil_aggregator_decisions_total[$__rate_interval]))", "{{detector}}")],
            width=12),
        Panel("Reports ingested per second", [Target("sum(rate(vigil_aggregator_reports_total[$__rate_interval]))",
                                                     "accepted"),
                                              Target("sum by (reason) (rate(vigil_aggregator_report_rejections_total"
                                                     "[$__rate_interval]))", "rejected: {{reason}}")],
              unit="reqps", width=12),
        Panel("Aggregator evaluation time (p99)", [Target(
            "histogram_quantile(0.99, sum by (le) (rate(vigil_aggregator_evaluate_duration_seconds_bucket"
            "[$__rate_interval])))", "p99")], unit="s", width=12),
        Row("Acting side: gate, breaker, deliveries, store"),
        Panel("Circuit breaker", [Target("max(vigil_aggregator_breaker_tripped)", instant=True)], kind="stat",
              width=4, height=5, description="1: tripped, automation stopped until `vigil aggregator breaker reset`.",
              defaults={"thresholds": {"mode": "absolute", "steps": [
                  {"color": "green", "value": None}, {"color": "red", "value": 1}]}}),
        Panel("Breaker: removals in window vs budget",
              [Target("max(vigil_aggregator_breaker_removals)", "removed nodes"),
               Target("max(vigil_aggregator_breaker_budget_nodes)", "budget")], width=8, height=5),
        Panel("Decision store", [Target("min(vigil_aggregator_store_up)", "store up"),
                                 Target("sum(vigil_aggregator_store_unstored_decisions)", "waiting in memory"),
                                 Target("sum by (kind) (increase(vigil_aggregator_store_errors_total"
                                        "[$__rate_interval]))", "errors: {{kind}}")],
              width=12, height=5, description="While the store fails /healthz answers 503 and decisions wait."),
        Panel("Verdicts by reason", [Target(
            "sum by (verdict) (increase(vigil_aggregator_decisions_total[$__rate_interval]))", "{{verdict}}")],
            width=12, description="Every recorded verdict: admitted, escalated, or refused and why."),
        Panel("Deliveries by actuator and outcome", [Target(
            "sum by (actuator, outcome) (increase(vigil_aggregator_deliveries_total[$__rate_interval]))",
            "{{actuator}} {{outcome}}")], width=12),
        Panel("Deliveries pending and dead-lettered",
              [Target("sum by (actuator) (vigil_aggregator_deliveries_pending)", "pending {{actuator}}"),
               Target("sum by (actuator) (vigil_aggregator_deliveries_dead)", "dead {{actuator}}")], width=8),
        Panel("Actuators reachable at start-up", [Target("vigil_aggregator_actuator_up", "{{actuator}}")],
              width=8),
        Panel("Event-loop lag, garbage-collection pauses, time since evaluation",
              [Target("max(vigil_aggregator_event_loop_lag_seconds)", "loop lag"),
               Target("max by (generation) (increase(vigil_aggregator_gc_pause_seconds_sum[10m])"
                      " / increase(vigil_aggregator_gc_pause_seconds_count[10m]))",
                      "mean GC pause, generation {{generation}}"),
               Target("time() - max(vigil_aggregator_last_evaluation_timestamp_seconds)", "since evaluation")],
              unit="s", width=8),
        Row("GPU faults"),
        Panel("Xid rate by code", [Target("sum by (code) (node_gpu_code:vigil_gpu_xid_errors:rate5m)",
                                          "Xid {{code}} (kernel log)"),
                                   Target("sum by (code) (node_gpu_code:vigil_gpu_nvml_xid_events:rate5m)",
                                          "Xid {{code}} (NVML)")], unit="ops", width=12,
              description="The same faults seen twice where both sources work: the kernel log (xid collector) "
                          "and NVML's event API (gpu collector)."),
        Panel("AMD GPU driver events by event", [Target(
            "sum by (event, block) (rate(vigil_amdgpu_events_total[5m])) > 0", "{{event}} {{block}}")],
              unit="ops", width=12,
              description="amdgpu kernel-log events (RAS errors by block, poison, bad-page threshold, ring "
                          "timeouts, GPU resets): AMD's counterpart of the Xids; aggregator/amdgpu_catalog.py "
                          "names them."),
        _table("Worst GPUs: AMD driver events in the range",
               'topk(10, sum by (node, gpu, uuid, event, block) (increase(vigil_amdgpu_events_total'
               '{event!~"gpu_reset_begin|gpu_reset_succeeded|ras_correctable|ring_timeout_recovered"}[$__range])))'
               ' > 0', description="The events that can act (the driver's own recoveries left out)."),
        Panel("GPUs with a failed or pending row remap",
              [Target("sum(vigil_gpu_row_remap_failure)", "remap failed"),
               Target("sum(vigil_gpu_row_remap_pending)", "remap pending"),
               Target('sum(vigil_gpu_health{state!="ok"})', "not healthy")], width=12),
        _table("Worst GPUs: Xids in the range",
               f"topk(10, {_xids_per_gpu('', '$__range')}) > 0",
               description="Per GPU, the larger of the kernel log's and NVML's counts (the same faults)."),
        _table("Worst GPUs: corrected ECC errors per second",
               'topk(10, node_gpu:vigil_gpu_ecc_errors:rate5m{error_type="corrected"}) > 0'),
        _table("Hottest GPUs", "topk(10, vigil_gpu_temperature_celsius)", unit="celsius"),
        _table("Most throttled GPUs (share of 5 min)",
               'topk(10, node_gpu_reason:vigil_gpu_clock_event_active:avg5m{reason!="sw_power_cap"}) > 0',
               unit="percentunit"),
        Row("Fabric"),
        _table("RDMA ports not ACTIVE", "vigil_rdma_port_state < 4", width=12),
        Panel("Symbol errors per second (worst ports)",
              [Target("topk(10, node_device_port:vigil_rdma_port_symbol_errors:rate5m) > 0",
                      "{{node}} {{device}}/{{port}}")], unit="ops", width=12),
        Row("NVLink fabric, PCIe links and configuration"),
        Panel("Nodes with Fabric Manager not active",
              [Target('count(vigil_fabric_manager_state{state="active"} == 0) or vector(0)', instant=True)],
              kind="stat", width=6, height=5,
              description="NVSwitch nodes only (the series is absent where Fabric Manager is not expected).",
              defaults={"thresholds": {"mode": "absolute", "steps": [
                  {"color": "green", "value": None}, {"color": "red", "value": 1}]}}),
        Panel("Nodes by driver version", [Target("count by (driver_version) (vigil_node_config_info)",
                                                 "{{driver_version}}")],
              width=18, height=5, options={"stacking": {"mode": "normal"}},
              description="More than one version is a roll-out in progress or a node left behind "
                          "(the config_drift detector names the node, or the job's mix)."),
        _table("GPUs not registered with the NVLink fabric", 'vigil_gpu_fabric_state{state!="completed"} == 1',
               description="A booting node's GPUs are in_progress for a minute or two; the fabric detector waits "
                           "out a 300 s boot grace."),
        _table("PCIe links below their maximum under load (GPUs)",
               f"({GPU_LINK_BELOW}) and on (node, gpu, uuid) (vigil_gpu_utilization_ratio >= 0.5)",
               description="Idle GPUs lower their link generation to save power: only busy GPUs are listed."),
        _table("PCIe links below their maximum (HCAs)", HCA_LINK_BELOW),
        _table("PCIe AER errors in the range",
               "sum by (node, pci_bus_id, kind, device, severity) (increase(vigil_pcie_aer_errors_total[$__range]))"
               " > 0"),
        _table("Configurations in the fleet (nodes per combination)",
               "count by (gpu_model, driver_version, cuda_driver_version, kernel, vbios_version, hca_firmware, "
               "ofed_version) (vigil_node_config_info)", width=24),
        *_precision_panels(),
    ]
    return dashboard("vigil-fleet", "vigil / Fleet overview",
                     "Every node's agent, the aggregator's verdicts and decisions, and the worst GPUs and ports.",
                     [], items)


def node() -> dict[str, Any]:
    # Every panel works for NVIDIA (NVML) and AMD (amdsmi) GPUs: the agent reports both under the
    # same metric names (docs/amd.md); the model variable picks a hardware class.
    sel = 'node="$node", gpu=~"$gpu"'
    gpu_legend = "GPU {{gpu}}"
    items: list[Panel | Row] = [
        Row("Identity and health"),
        _table("GPUs", 'vigil_gpu_info{node="$node"}', width=16),
        Panel("Collectors succeeding", [Target('vigil_collector_success{node="$node"}', "{{collector}}")],
              kind="state-timeline", width=8, height=8),
        Panel("GPU health", [Target(f'vigil_gpu_health{{{sel}}} == 1', gpu_legend + " {{state}}")],
              kind="state-timeline", width=24, height=6,
              description="The GPU library's view of each GPU (NVML on NVIDIA, amdsmi on AMD)."),
        Row("Clocks, temperatures, power"),
        Panel("Graphics (SM) clock", [Target(f"vigil_gpu_sm_clock_hertz{{{sel}}}", gpu_legend)], unit="hertz",
              width=8, description="NVIDIA's SM clock; AMD's graphics (SCLK) clock."),
        Panel("Memory clock", [Target(f"vigil_gpu_memory_clock_hertz{{{sel}}}", gpu_legend)], unit="hertz", width=8),
        Panel("Utilization", [Target(f"vigil_gpu_utilization_ratio{{{sel}}}", gpu_legend)], unit="percentunit",
              width=8),
        Panel("GPU temperature", [Target(f"vigil_gpu_temperature_celsius{{{sel}}}", gpu_legend),
                                  Target(f"max(vigil_gpu_slowdown_temperature_celsius{{{sel}}})", "slowdown")],
              unit="celsius", width=8),
        Panel("HBM (memory) temperature", [Target(f"vigil_gpu_memory_temperature_celsius{{{sel}}}", gpu_legend),
                                  Target(f"max(vigil_gpu_memory_max_operating_temperature_celsius{{{sel}}})",
                                         "max operating")], unit="celsius", width=8),
        Panel("Power", [Target(f"vigil_gpu_power_watts{{{sel}}}", gpu_legend),
                        Target(f"max(vigil_gpu_power_limit_watts{{{sel}}})", "limit")], unit="watt", width=8),
        Panel("Clock event reasons (throttling)",
              [Target(f'vigil_gpu_clock_event_active{{{sel}, reason!="gpu_idle"}} == 1', gpu_legend + " {{reason}}")],
              kind="state-timeline", width=24, height=8,
              description="What holds the clocks down: NVML's clock event reasons on NVIDIA, amdsmi's violation "
                          "status on AMD, under one set of names; sw_power_cap is normal at full load."),
        Row("Memory errors"),
        Panel("ECC errors per second", [Target(
            f'rate(vigil_gpu_ecc_errors_total{{{sel}, counter="volatile"}}[$__rate_interval])',
            gpu_legend + " {{error_type}}")], unit="ops", width=8),
        Panel("Remapped rows", [Target(f"vigil_gpu_remapped_rows_total{{{sel}}}", gpu_legend + " {{error_type}}")],
              width=8),
        Panel("Row remap pending / failed", [Target(f"vigil_gpu_row_remap_pending{{{sel}}}", gpu_legend + " pending"),
                                             Target(f"vigil_gpu_row_remap_failure{{{sel}}}", gpu_legend + " failed")],
              width=8),
        Panel("Retired pages", [Target(f"vigil_gpu_retired_pages_total{{{sel}}}", gpu_legend + " {{cause}}")],
              width=12, description="Retired memory pages: NVIDIA before A100 (A100 and later remap rows instead) "
                                    "and AMD Instinct (amdgpu's bad pages)."),
        Panel("Xids in the range", [Target(f"{_xids_by_source(sel, '$__range')} > 0",
                                           gpu_legend + " Xid {{code}} ({{source}})", instant=True)],
              kind="table", width=12,
              description="NVIDIA: Xids per GPU and code from the kernel log (source kmsg) and NVML's event API "
                          "(nvml)."),
        Panel("AMD driver events in the range", [Target(
            f"sum by (gpu, event, block) (increase(vigil_amdgpu_events_total{{{sel}}}[$__range])) > 0",
            gpu_legend + " {{event}} {{block}}", instant=True)], kind="table", width=12,
              description="AMD: amdgpu kernel-log events per GPU (RAS errors by block, poison, bad-page "
                          "threshold, ring timeouts, GPU resets); aggregator/amdgpu_catalog.py says what each means."),
        Row("GPU links (NVLink / XGMI) and PCIe"),
        Panel("GPU links down (NVLink / XGMI)",
              [Target(f"vigil_gpu_nvlink_state{{{sel}}} == 0", gpu_legend + " link {{link}}")],
              kind="state-timeline", width=12,
              description="NVIDIA NVLink or AMD Infinity Fabric (XGMI) links, under the same metric."),
        Panel("GPU link errors per second (NVLink / XGMI)", [Target(
            f"sum by (gpu, error_type) (rate(vigil_gpu_nvlink_errors_total{{{sel}}}[$__rate_interval]))",
            gpu_legend + " {{error_type}}")], unit="ops", width=12),
        Panel("PCIe replays per second", [Target(
            f"rate(vigil_gpu_pcie_replay_total{{{sel}}}[$__rate_interval])", gpu_legend)], unit="ops", width=12),
        Panel("PCIe throughput", [Target(f"vigil_gpu_pcie_throughput_bytes_per_second{{{sel}}}",
                                         gpu_legend + " {{direction}}")], unit="Bps", width=12),
        Row("NVLink fabric, PCIe links and configuration"),
        Panel("GPU fabric state", [Target(f"vigil_gpu_fabric_state{{{sel}}} == 1", gpu_legend + " {{state}}")],
              kind="state-timeline", width=12,
              description="Fabric Manager's registration of each GPU (NVSwitch systems): completed is usable."),
        Panel("Fabric Manager", [Target('vigil_fabric_manager_state{node="$node"} == 1', "{{state}}")],
              kind="state-timeline", width=12),
        Panel("GPU PCIe link generation", [
            Target(f"vigil_gpu_pcie_link_generation{{{sel}}}", gpu_legend),
            Target(f"max(vigil_gpu_pcie_link_generation_max{{{sel}}})", "max")], width=8,
            description="Idle GPUs lower the generation to save power; under load it must be at its maximum."),
        Panel("GPU PCIe link width", [
            Target(f"vigil_gpu_pcie_link_width{{{sel}}}", gpu_legend),
            Target(f"max(vigil_gpu_pcie_link_width_max{{{sel}}})", "max")], width=8),
        Panel("GPU recovery action (NVIDIA)",
              [Target(f'vigil_gpu_recovery_action{{{sel}, action!="none"}} == 1', gpu_legend + " {{action}}")],
              kind="state-timeline", width=8,
              description="What the driver says recovers the GPU after an error (none when healthy)."),
        _table("HCA and GPU PCIe devices (sysfs)", 'vigil_pcie_link_width{node="$node"}', width=12),
        Panel("PCIe AER errors per second", [Target(
            'rate(vigil_pcie_aer_errors_total{node="$node"}[$__rate_interval]) > 0',
            "{{kind}} {{device}} {{pci_bus_id}} {{severity}}")], unit="ops", width=12),
        _table("Configuration", 'vigil_node_config_info{node="$node"}', width=24),
        Row("RDMA ports"),
        Panel("Port state", [Target('vigil_rdma_port_state{node="$node"}', "{{device}}/{{port}} {{state}}")],
              kind="state-timeline", width=12,
              description="IBTA logical port state: 4 is ACTIVE; anything else carries no traffic."),
        Panel("Port rate", [Target('vigil_rdma_port_rate_bytes_per_second{node="$node"}', "{{device}}/{{port}}")],
              unit="Bps", width=12),
        Panel("Data received / transmitted", [
            Target('rate(vigil_rdma_port_data_received_bytes_total{node="$node"}[$__rate_interval])',
                   "{{device}}/{{port}} rx"),
            Target('rate(vigil_rdma_port_data_transmitted_bytes_total{node="$node"}[$__rate_interval])',
                   "{{device}}/{{port}} tx")], unit="Bps", width=12),
        Panel("Link errors per second", [
            Target('rate(vigil_rdma_port_symbol_errors_total{node="$node"}[$__rate_interval])',
                   "{{device}}/{{port}} symbol"),
            Target('rate(vigil_rdma_port_receive_errors_total{node="$node"}[$__rate_interval])',
                   "{{device}}/{{port}} receive"),
            Target('rate(vigil_rdma_port_link_error_recoveries_total{node="$node"}[$__rate_interval])',
                   "{{device}}/{{port}} recoveries"),
            Target('rate(vigil_rdma_port_link_downed_total{node="$node"}[$__rate_interval])',
                   "{{device}}/{{port}} downed")], unit="ops", width=12),
        Panel("Congestion (transmit wait, ECN, PFC pauses)", [
            Target('rate(vigil_rdma_port_transmit_wait_total{node="$node"}[$__rate_interval])',
                   "{{device}}/{{port}} xmit wait"),
            Target('rate(vigil_rdma_port_ecn_marked_packets_total{node="$node"}[$__rate_interval])',
                   "{{device}}/{{port}} ECN"),
            Target('sum by (device, port) (rate(vigil_rdma_port_pfc_pause_frames_total{node="$node"}'
                   '[$__rate_interval]))', "{{device}}/{{port}} PFC")], unit="ops", width=24),
    ]
    variables = [_query_var("model", "GPU model", "label_values(vigil_gpu_info, name)", multi=True),
                 _query_var("node", "Node", 'label_values(vigil_gpu_info{name=~"$model"}, node)'),
                 _query_var("gpu", "GPU", 'label_values(vigil_gpu_info{node="$node"}, gpu)', multi=True)]
    return dashboard("vigil-node", "vigil / Node drill-down",
                     "One node, NVIDIA or AMD: every GPU's clocks, temperatures, power, throttling, memory errors, "
                     "GPU links (NVLink / XGMI) and PCIe, and every RDMA port.", variables, items)


# The job view's bottleneck hints, a roofline rule of thumb rather than a measured limit: a job
# holding DRAM at >= 80% of its peak bandwidth is bandwidth-bound (bandwidth-bound kernels reach
# ~90% of peak, compute-bound training steps far less), and tensor activity below 20% is a small
# share of a dense-transformer step's ~50% (the fake's training model). A busy GPU whose SM clock
# sits below 80% of its maximum is held down (a healthy loaded HGX board boosts to within a few
# percent of its maximum).
MEMORY_BOUND_DRAM_RATIO = 0.8
MEMORY_BOUND_TENSOR_RATIO = 0.2
BUSY_RATIO = 0.5
CAPPED_CLOCK_RATIO = 0.8


# The VigilTrainingStraggler threshold (rules/vigil-alerts.rules.yml; a test keeps them equal).
STRAGGLER_RATIO = 1.1


def _job_gpus(metric: str, sel: str) -> str:
    """``metric`` for the GPUs of the nodes the job's ranks run on (joined on the node label)."""
    nodes = f"group by (node) (node_training_job:vigil_training_step_seconds:max{{{sel}}})"
    return f"({metric} * on (node) group_left () {nodes})"


def job() -> dict[str, Any]:
    sel = 'training_job="$training_job"'
    items: list[Panel | Row] = [
        Row("Step time"),
        Panel("Step time per rank", [Target(f"node_training_job_rank:vigil_training_step_seconds:last{{{sel}}}",
                                            "rank {{rank}} ({{node}})")], unit="s", width=16),
        Panel("Job step time", [Target(f"training_job:vigil_training_step_seconds:median{{{sel}}}", "median"),
                                Target(f"training_job:vigil_training_step_seconds:p90{{{sel}}}", "p90"),
                                Target(f"training_job:vigil_training_step_seconds:max{{{sel}}}", "slowest rank")],
              unit="s", width=8),
        Panel("Straggler score per node", [Target(
            f"node_training_job:vigil_training_compute_data_seconds:ratio_to_job_median{{{sel}}}", "{{node}}")],
            width=12, description="The compute plus data-loading time of the node's slowest rank over the job's "
                                  "median rank's (1.0 = on pace; step time is equal on every rank of a "
                                  "synchronous job); the ticket alert fires above 1.1 for 10 minutes.",
            defaults={"thresholds": {"mode": "absolute", "steps": [{"color": "green", "value": None},
                                                                   {"color": "red", "value": STRAGGLER_RATIO}]}}),
        Panel("Slowest nodes now", [
            Target(f"topk(10, node_training_job:vigil_training_compute_data_seconds:ratio_to_job_median{{{sel}}})",
                   instant=True),
            Target(f"node_training_job:vigil_training_data_seconds:max{{{sel}}}", instant=True)],
            kind="table", width=12,
            description="First query: the straggler score (compute + data time over the job's median); second: "
                        "the node's longest data-loading time per step in seconds (a slow loader, not a slow GPU)."),
        Row("Where the step goes"),
        Panel("Compute / comm / data split (job median)", [Target(
            f"quantile by (phase) (0.5, node_training_job_rank_phase:vigil_training_phase_seconds:last{{{sel}}})",
            "{{phase}}")], unit="s", width=12, options={"stacking": {"mode": "normal"}},
            description="In synchronous training the slow rank has the longest compute and the shortest comm wait."),
        Panel("Compute time per rank", [Target(
            f'node_training_job_rank_phase:vigil_training_phase_seconds:last{{{sel}, phase="compute"}}',
            "rank {{rank}} ({{node}})")], unit="s", width=12),
        Panel("Comm time per rank", [Target(
            f'node_training_job_rank_phase:vigil_training_phase_seconds:last{{{sel}, phase="comm"}}',
            "rank {{rank}} ({{node}})")], unit="s", width=12),
        Panel("Data loading time per rank", [Target(
            f'node_training_job_rank_phase:vigil_training_phase_seconds:last{{{sel}, phase="data"}}',
            "rank {{rank}} ({{node}})")], unit="s", width=12),
        Row("What the GPUs are doing (NVML GPM, Hopper and later)"),
        Panel("DRAM bandwidth used per GPU", [Target(_job_gpus("vigil_gpu_dram_active_ratio", sel),
                                                     "{{node}} GPU {{gpu}}")],
              unit="percentunit", width=8, description="HBM bandwidth used over its maximum. Near 1 with tensor "
                                                       "activity low: the job is memory-bound."),
        Panel("Tensor core activity per GPU", [Target(_job_gpus("vigil_gpu_tensor_active_ratio", sel),
                                                      "{{node}} GPU {{gpu}}")],
              unit="percentunit", width=8, description="Share of time the SMs ran tensor-core operations."),
        Panel("SM activity per GPU", [Target(_job_gpus("vigil_gpu_sm_active_ratio", sel), "{{node}} GPU {{gpu}}")],
              unit="percentunit", width=8),
        Panel("Capped vs memory-bound GPUs", [
            Target(f"count by (node) ({_job_gpus('vigil_gpu_dram_active_ratio', sel)} >= {MEMORY_BOUND_DRAM_RATIO}"
                   f" and on (node, gpu) vigil_gpu_tensor_active_ratio < {MEMORY_BOUND_TENSOR_RATIO})",
                   "{{node}} memory-bound"),
            Target(f"count by (node) ({_job_gpus('vigil_gpu_utilization_ratio', sel)} > {BUSY_RATIO}"
                   f" and on (node, gpu) (vigil_gpu_sm_clock_hertz / vigil_gpu_sm_clock_max_hertz)"
                   f" < {CAPPED_CLOCK_RATIO})", "{{node}} capped"),
        ], width=24, description=f"Memory-bound: DRAM bandwidth >= {MEMORY_BOUND_DRAM_RATIO:.0%} of its maximum "
                                 f"with tensor activity < {MEMORY_BOUND_TENSOR_RATIO:.0%}. Capped: busy (> "
                                 f"{BUSY_RATIO:.0%}) with the SM clock < {CAPPED_CLOCK_RATIO:.0%} of its maximum "
                                 "(power cap, power brake or thermal slowdown: see the node view's clock events)."),
        Row("Progress"),
        Panel("Ranks not running", [Target(
            'vigil_training_rank_state{exported_job="$training_job", state!="running"} == 1',
            "rank {{rank}} ({{node}}) {{state}}")], kind="state-timeline", width=12),
        Panel("Heartbeats per second", [Target(
            'sum by (node) (rate(vigil_training_heartbeats_received_total{exported_job="$training_job"}'
            '[$__rate_interval]))', "{{node}}")], unit="ops", width=12),
    ]
    variables = [_query_var("training_job", "Job",
                            "label_values(node_training_job_rank:vigil_training_step_seconds:last, training_job)")]
    return dashboard("vigil-job", "vigil / Training job",
                     "One training job: per-rank step time, its compute/comm/data split, and the straggler score.",
                     variables, items)


DASHBOARDS = {"vigil-fleet.json": fleet, "vigil-node.json": node, "vigil-job.json": job}


def render(build: Any) -> str:
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    out = Path(argv[0]) if argv else OUT_DIR
    for name, build in DASHBOARDS.items():
        (out / name).write_text(render(build))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""dashboards/: the checked-in JSON is build.py's output, has a valid Grafana structure with the
datasource as a variable and stable uids, and every query parses (promtool) and uses only
metrics the agent, the aggregator or rules/ provide."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from dashboards import build
from tests.rules.promql_names import catalog_names, metric_names

DIR = Path(build.__file__).resolve().parent
RULES = DIR.parent / "rules"
PROMTOOL = shutil.which("promtool")

# Grafana's variables, replaced by values of the right shape before promtool parses a query.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "1m", "$__range": "1h", "${datasource}": "prom",
                     "$training_job": "llm", "$node": "n1", "$gpu": ".*", "$model": ".*"}


def dashboards() -> dict[str, dict[str, Any]]:
    return {name: json.loads((DIR / name).read_text()) for name in build.DASHBOARDS}


def panels(board: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in board["panels"] if p["type"] != "row"]


def expressions() -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for name, board in dashboards().items():
        for panel in panels(board):
            out.extend((f"{name}: {panel['title']}", t["expr"]) for t in panel["targets"])
        for var in board["templating"]["list"]:
            if var["type"] == "query":
                inner = re.fullmatch(r"label_values\((.+), *\w+\)", var["query"]["query"])
                assert inner, var["query"]
                out.append((f"{name}: variable {var['name']}", inner.group(1)))
    return out


def substitute(expr: str) -> str:
    for var, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(var, value)
    assert "$" not in expr.replace("$1", ""), expr
    return expr


def test_checked_in_json_is_the_builders_output() -> None:
    for name, make in build.DASHBOARDS.items():
        assert (DIR / name).read_text() == build.render(make), f"{name} is stale: run python -m dashboards.build"


def test_the_three_views_with_stable_uids() -> None:
    boards = dashboards()
    assert {b["uid"] for b in boards.values()} == {"vigil-fleet", "vigil-node", "vigil-job"}
    for board in boards.values():
        assert board["title"].startswith("vigil / ") and "vigil" in board["tags"]


def test_structure_ids_grid_targets_and_datasource_variable() -> None:
    for name, board in dashboards().items():
        variables = {v["name"]: v for v in board["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids)) and all(isinstance(i, int) for i in ids), name
        for panel in board["panels"]:
            grid = panel["gridPos"]
            assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24 and grid["h"] > 0, (name, panel["title"])
        for panel in panels(board):
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
            assert panel["targets"], panel["title"]
            ref_ids = [t["refId"] for t in panel["targets"]]
            assert len(ref_ids) == len(set(ref_ids))
            for target in panel["targets"]:
                assert target["datasource"]["uid"] == "${datasource}" and target["expr"].strip()
        # Every variable a query uses is defined on the dashboard.
        for panel in panels(board):
            for target in panel["targets"]:
                for used in re.findall(r"\$(\w+)", target["expr"]):
                    assert used.startswith("__") or used in variables, (name, used)


def test_panels_do_not_overlap() -> None:
    for name, board in dashboards().items():
        taken: set[tuple[int, int]] = set()
        for panel in board["panels"]:
            g = panel["gridPos"]
            cells = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
            assert not cells & taken, (name, panel["title"])
            taken |= cells


def test_drill_down_covers_what_an_operator_checks() -> None:
    node = dashboards()["vigil-node.json"]
    text = json.dumps(node)
    for metric in ("vigil_gpu_sm_clock_hertz", "vigil_gpu_temperature_celsius", "vigil_gpu_memory_temperature_celsius",
                   "vigil_gpu_power_watts", "vigil_gpu_clock_event_active", "vigil_gpu_ecc_errors_total",
                   "vigil_gpu_remapped_rows_total", "vigil_gpu_nvlink_state", "vigil_gpu_nvlink_errors_total",
                   "vigil_gpu_pcie_replay_total", "vigil_rdma_port_state", "vigil_rdma_port_symbol_errors_total"):
        assert metric in text, metric
    job = json.dumps(dashboards()["vigil-job.json"])
    assert "ratio_to_job_median" in job and 'phase=\\"compute\\"' in job


def test_every_metric_exists() -> None:
    recorded = {r["record"] for path in RULES.glob("*.rules.yml")
                for group in yaml.safe_load(path.read_text())["groups"] for r in group["rules"] if "record" in r}
    known = catalog_names() | recorded
    for where, expr in expressions():
        used = metric_names(substitute(expr))
        assert used, (where, expr)
        assert used <= known, f"{where}: undeclared {sorted(used - known)}"


@pytest.mark.external
@pytest.mark.skipif(PROMTOOL is None, reason="promtool missing (apt-get install prometheus)")
def test_every_expression_parses(tmp_path: Path) -> None:
    rules = [{"record": f"dashboard:check:q{i}", "expr": substitute(expr)} for i, (_, expr) in enumerate(expressions())]
    path = tmp_path / "dashboards.rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    done = subprocess.run([str(PROMTOOL), "check", "rules", str(path)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{len(rules)} rules found" in done.stdout


def test_xid_panels_read_both_sources_and_the_straggler_views_compute_time() -> None:
    xid_exprs = [expr for title, expr in expressions() if "Xid" in title]
    assert len(xid_exprs) == 4  # fleet: rate by code (2 targets), worst GPUs; node: Xids in the range
    assert any("nvml_xid_events" in e for e in xid_exprs[:2]) and all(
        "vigil_gpu_xid_errors" in e or "nvml_xid_events" in e for e in xid_exprs)
    assert all("vigil_gpu_xid_errors" in e and "nvml_xid_events" in e for e in xid_exprs[2:])
    job = {p["title"]: p for p in panels(dashboards()["vigil-job.json"])}
    slowest = [t["expr"] for t in job["Slowest nodes now"]["targets"]]
    assert "compute_data_seconds:ratio_to_job_median" in slowest[0] and "data_seconds:max" in slowest[1]
    assert "step_seconds" not in " ".join(slowest)
    alert = next(r for g in yaml.safe_load((RULES / "vigil-alerts.rules.yml").read_text())["groups"]
                 for r in g["rules"] if r.get("alert") == "VigilTrainingStraggler")
    assert alert["expr"] == (
        f"node_training_job:vigil_training_compute_data_seconds:ratio_to_job_median > {build.STRAGGLER_RATIO}")

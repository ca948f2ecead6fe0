"""rules/: syntax and unit tests through the real promtool, and checks that every alert is
complete, tested both ways, and built only on metrics the agent or aggregator declares."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.rules.promql_names import catalog_names, metric_names
from vigil.agent.collectors.xid import PAGED_XID_CODES
from vigil.aggregator.amdgpu_catalog import ENTRIES as AMDGPU_ENTRIES
from vigil.aggregator.decision import Action
from vigil.aggregator.detectors.amdgpu import AmdgpuConfig
from vigil.aggregator.xid_catalog import XidCatalog

RULES = Path(__file__).resolve().parents[2] / "rules"
RULE_FILES = sorted(RULES.glob("*.rules.yml"))
TEST_FILES = sorted((RULES / "tests").glob("*.test.yml"))
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool missing (apt-get install prometheus)")


def _rules() -> list[dict[str, Any]]:
    out = []
    for path in RULE_FILES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            out.extend(group["rules"])
    return out


def _alerts() -> dict[str, dict[str, Any]]:
    return {r["alert"]: r for r in _rules() if "alert" in r}


def test_rule_files_exist() -> None:
    assert [p.name for p in RULE_FILES] == ["vigil-alerts.rules.yml", "vigil-recording.rules.yml"]
    assert TEST_FILES


@pytest.mark.external
@needs_promtool
def test_promtool_check_rules() -> None:
    done = subprocess.run([str(PROMTOOL), "check", "rules", *map(str, RULE_FILES)], capture_output=True,
                          text=True, timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.external
@needs_promtool
def test_promtool_unit_tests_pass() -> None:
    done = subprocess.run([str(PROMTOOL), "test", "rules", *(p.name for p in TEST_FILES)], cwd=RULES / "tests",
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_alert_has_tier_and_annotations() -> None:
    alerts = _alerts()
    assert len(alerts) >= 10
    for name, rule in alerts.items():
        labels, notes = rule.get("labels", {}), rule.get("annotations", {})
        assert name.startswith("Vigil"), name
        assert labels.get("severity") in ("page", "ticket"), name
        # Pages are hardware faults, or vigil's own acting side failing (tier "vigil").
        tiers = {"page": ("hardware", "vigil"), "ticket": ("performance",)}[labels["severity"]]
        assert labels.get("tier") in tiers, name
        for key in ("summary", "description", "runbook"):
            assert notes.get(key, "").strip(), f"{name} lacks {key}"


def test_page_alerts_name_a_vigil_action_and_tickets_do_not() -> None:
    for name, rule in _alerts().items():
        action = rule["labels"].get("vigil_action")
        if rule["labels"]["severity"] == "page" and rule["labels"]["tier"] == "hardware":
            assert action is not None, name
            assert Action(action) in (Action.DRAIN, Action.RESET_GPU, Action.REBOOT_NODE, Action.INSPECT_HARDWARE)
        else:
            assert action is None, f"{name}: ticket alerts inform people, they do not ask the aggregator to act"


def _tested(kind: str) -> set[str]:
    """Alert names with a case where they fire (kind='fire') or where they stay silent ('silent')."""
    found: set[str] = set()
    for path in TEST_FILES:
        for case in yaml.safe_load(path.read_text())["tests"]:
            for check in case.get("alert_rule_test", []):
                fires = bool(check.get("exp_alerts"))
                if fires == (kind == "fire"):
                    found.add(check["alertname"])
    return found


def test_every_alert_is_tested_firing_and_not_firing() -> None:
    alerts = set(_alerts())
    assert alerts - _tested("fire") == set()
    assert alerts - _tested("silent") == set()


def test_every_metric_a_rule_uses_is_declared() -> None:
    recorded = {r["record"] for r in _rules() if "record" in r}
    known = catalog_names() | recorded
    for rule in _rules():
        used = metric_names(rule["expr"])
        assert used, f"{rule.get('alert') or rule.get('record')}: no metric found in {rule['expr']!r}"
        assert used <= known, f"{rule.get('alert') or rule.get('record')} uses undeclared {sorted(used - known)}"


def test_recorded_names_follow_level_metric_operation() -> None:
    for rule in _rules():
        if "record" in rule:
            level, metric, operation = rule["record"].split(":")
            assert level and operation and metric.startswith("vigil_"), rule["record"]


def _codes(alert: str) -> set[int]:
    """The alert's Xid codes; every selector of the alert (both sources, every arm) names the same."""
    arms = _alerts()[alert]["expr"].split('code=~"')[1:]
    selectors = {arm[:arm.index('"')] for arm in arms}
    assert len(arms) == 4 and len(selectors) == 1, selectors
    return {int(c) for c in selectors.pop().split("|")}


@pytest.mark.parametrize("alert", ["VigilGpuXidResetRequired", "VigilGpuXidRebootRequired",
                                   "VigilGpuXidInspectHardware"])
def test_xid_alerts_read_both_sources_and_the_agent_starts_their_codes_at_zero(alert: str) -> None:
    expr = _alerts()[alert]["expr"]
    assert "increase(vigil_gpu_xid_errors_total{" in expr and "increase(vigil_gpu_nvml_xid_events_total{" in expr
    assert _codes(alert) <= set(PAGED_XID_CODES)


@pytest.mark.parametrize(("alert", "action"), [
    ("VigilGpuXidResetRequired", Action.RESET_GPU),
    ("VigilGpuXidRebootRequired", Action.REBOOT_NODE),
    ("VigilGpuXidInspectHardware", Action.INSPECT_HARDWARE),
])
def test_xid_alerts_follow_the_xid_catalog(alert: str, action: Action) -> None:
    catalog = XidCatalog.default()
    expected = {code for code in catalog.codes() if catalog.entry(code).action is action}
    assert expected, action
    assert _codes(alert) == expected
    assert _alerts()[alert]["labels"]["vigil_action"] == action.value


def _amdgpu_events(alert: str) -> set[str]:
    """The amdgpu events an alert selects; every selector of it names the same."""
    expr = _alerts()[alert]["expr"]
    selectors = {arm[:arm.index('"')] for arm in re.split(r'event=~?"', expr)[1:]}
    assert len(selectors) == 1, selectors
    return set(selectors.pop().split("|"))


@pytest.mark.parametrize(("alert", "action"), [
    ("VigilAmdGpuResetRequired", Action.RESET_GPU),
    ("VigilAmdGpuBadPageThreshold", Action.INSPECT_HARDWARE),
    ("VigilAmdGpuResetFailed", Action.REBOOT_NODE),
])
def test_amdgpu_alerts_follow_the_amdgpu_catalog(alert: str, action: Action) -> None:
    expected = {e.name for e in AMDGPU_ENTRIES if e.category == "hardware" and e.action is action}
    assert expected, action
    assert _amdgpu_events(alert) == expected
    assert _alerts()[alert]["labels"]["vigil_action"] == action.value


def test_every_acting_amdgpu_event_pages_and_no_other_does() -> None:
    paging = {e for alert in _alerts() if alert.startswith("VigilAmdGpu") for e in _amdgpu_events(alert)}
    acting = {e.name for e in AMDGPU_ENTRIES if e.action not in (Action.OBSERVE, Action.ALERT)}
    # ring_timeout observes once; its page is the detector's repeat rule (drain), not the catalog action.
    assert paging == acting | {"ring_timeout"}
    repeat = _alerts()["VigilAmdGpuRingTimeoutRepeated"]
    assert repeat["labels"]["vigil_action"] == AmdgpuConfig().ring_timeout_repeat_action.value
    assert repeat["expr"].rstrip().endswith(f">= {AmdgpuConfig().ring_timeout_repeat_threshold}")


def test_metric_names_lexer_finds_selectors_not_functions() -> None:
    expr = ('sum by (node) (rate(vigil_gpu_xid_errors_total{code=~"48|79"}[5m])) > 0 '
            'and on (node) group_left max by (node) (up offset 5m) '
            '/ label_replace(vigil_training_step_seconds, "dst", "$1", "exported_job", "(.+)")')
    assert metric_names(expr) == {"vigil_gpu_xid_errors_total", "up", "vigil_training_step_seconds"}

"""The xid detector on NVLink Xids (74, 144-150: the action follows the register decode, the
evidence names link, unit and fatality) and on NVML's recovery action (the driver's verdict acts
on one report; "none" never acts), with the lookalikes that must not act."""

from __future__ import annotations

from typing import Any

import pytest

from tests.aggregator.conftest import FakeNode
from vigil.aggregator.decision import Action, Finding
from vigil.aggregator.detectors.xid import XidConfig, XidDetector
from vigil.aggregator.fleet import Fleet
from vigil.contract.wire import Event

DETECTOR = XidDetector(XidConfig())
REMOVALS = {Action.DRAIN, Action.RESET_GPU, Action.REBOOT_NODE, Action.INSPECT_HARDWARE, Action.RESTART_JOB}
FATAL_145 = "RLW_REMAP Fatal XC1 i0 Link 10 (0x00000082 0x00000040 0x00000000 0x00000000 0x00000000 0x00000000)"
NONFATAL_145 = "RLW_RXPIPE Nonfatal XC0 i0 Link 13 (0x0409a0c2 0x00000008 0x00000001 0x00000000 0x00100000 0x00000004)"
XID74 = "NVLink: fatal error detected on link 14(0x0, 0x0, 0x10000, 0x0, 0x0, 0x0, 0x0)"


def xid(code: int, ts: float, gpu: int, message: str) -> Event:
    return Event(kind="xid", ts=ts, code=code, gpu=gpu, source="kmsg", urgent=True, message=message)


def run(events_at: dict[float, list[Event]] | None = None, *, end: float = 30.0,
        gpu_fields: dict[float, dict[int, dict[str, Any]]] | None = None,
        config: XidConfig | None = None) -> list[Finding]:
    node = FakeNode("a")
    fleet = Fleet()
    t = 0.0
    while t <= end:
        for gpu, fields in (gpu_fields or {}).get(t, {}).items():
            node.gpus[gpu].update(fields)
        fleet.ingest(node.report(t, events=(events_at or {}).get(t, [])), t)
        t += 2.5
    return (XidDetector(config) if config else DETECTOR).evaluate(fleet.view(), t - 2.5)


def test_fatal_nvlink5_event_resets_the_gpu_naming_link_unit_and_fatality() -> None:
    [f] = run({10.0: [xid(145, 9.0, 2, FATAL_145)]})
    assert f.gpu == 2 and f.action is Action.RESET_GPU
    assert f.evidence["nvlink"] == {"link": 10, "fatal": True, "unit": "RLW_REMAP", "resolution": "RESET_GPU",
                                    "investigatory": "CONTACT_SUPPORT", "driver": "<R575"}
    assert "link 10" in f.reason and "unit RLW_REMAP" in f.reason


def test_non_fatal_nvlink5_event_with_resolution_ignore_never_removes() -> None:
    [f] = run({10.0: [xid(145, 9.0, 2, NONFATAL_145)]})
    assert f.action is Action.OBSERVE
    assert f.evidence["nvlink"]["fatal"] is False and f.evidence["nvlink"]["resolution"] == "IGNORE"


def test_xid74_follows_the_register_guide() -> None:
    [f] = run({10.0: [xid(74, 9.0, 1, XID74)]})
    assert f.action is Action.RESET_GPU
    assert f.evidence["nvlink"]["link"] == 14
    assert f.evidence["nvlink"]["register_bits"] == ["reg3.bit16=diags_if_repeated"]
    benign = "NVLink: fatal error detected on link 3(0x1, 0x0, 0x0, 0x0, 0x100000, 0x0, 0x0)"
    [g] = run({10.0: [xid(74, 9.0, 1, benign)]})
    assert g.action is Action.OBSERVE  # ignorable bit + ECC threshold: "continue operation"


@pytest.mark.parametrize(("wanted", "action"), [("gpu_reset", Action.RESET_GPU), ("node_reboot", Action.REBOOT_NODE),
                                                 ("drain_p2p", Action.DRAIN), ("drain_and_reset", Action.RESET_GPU)])
def test_the_drivers_recovery_action_acts_on_one_report(wanted: str, action: Action) -> None:
    [f] = run(gpu_fields={27.5: {5: {"recovery_action": wanted}}})
    assert f.gpu == 5 and f.action is action and f.key == f"recovery:{wanted}"
    assert f.since == 27.5 and f.evidence == {"signal": "recovery_action", "recovery_action": wanted,
                                              "uuid": "GPU-a-5"}


def test_recovery_action_since_is_the_start_of_its_run_and_stable() -> None:
    fields = {10.0: {5: {"recovery_action": "none"}}, 15.0: {5: {"recovery_action": "gpu_reset"}}}
    [f] = run(gpu_fields=fields, end=25.0)
    [g] = run(gpu_fields=fields, end=30.0)
    assert f.since == g.since == 15.0


def test_lookalikes_that_must_not_act() -> None:
    # The driver says none; a cleared action (none again after a reset); a non-fatal NVLink5 event.
    assert run(gpu_fields={5.0: {g: {"recovery_action": "none"} for g in range(8)}}) == []
    assert run(gpu_fields={5.0: {1: {"recovery_action": "gpu_reset"}}, 10.0: {1: {"recovery_action": "none"}}}) == []
    found = run({10.0: [xid(145, 9.0, 2, NONFATAL_145), xid(144, 9.1, 3, "SAW_MVB Nonfatal XC0 i0 Link 0 "
                                                                      "(0x00000001 0x00000008 0x0 0x0 0x0 0x0)")]})
    assert len(found) == 2 and not [f for f in found if f.action in REMOVALS]


def test_recovery_action_can_be_turned_off() -> None:
    assert run(gpu_fields={5.0: {1: {"recovery_action": "node_reboot"}}}, config=XidConfig(recovery_action=False)) == []

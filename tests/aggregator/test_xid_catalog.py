"""The Xid catalog: coverage of NVIDIA's catalog and the judgement rules of judge_xids."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from vigil.aggregator.decision import REMOVING_ACTIONS, Action
from vigil.aggregator.xid_catalog import (
    SxidCatalog,
    XidCatalog,
    XidOccurrence,
    judge_xids,
    load_entries,
    load_sxid_entries,
    occurrence_action,
    recovery_action,
)

NVIDIA_CSV = Path(__file__).parent.parent / "fixtures" / "xid-catalog" / "nvidia-xid-catalog.csv"
WINDOW = 3600.0
CATALOG = XidCatalog.default()


def judge(occs: list[XidOccurrence], *, now: float = 1000.0, pending: bool | None = False,
          failure: bool | None = False, threshold: int = 3, catalog: XidCatalog = CATALOG):
    return judge_xids(catalog, occs, remap_pending=pending, remap_failure=failure, now=now, window_seconds=WINDOW,
                      app_repeat_threshold=threshold)


def nvidia_rows() -> list[dict[str, str]]:
    with NVIDIA_CSV.open() as fh:
        return list(csv.DictReader(fh))


def test_every_nvidia_code_is_in_the_catalog_with_its_name() -> None:
    rows = nvidia_rows()
    assert len(rows) == 172
    for row in rows:
        entry = CATALOG.entry(int(row["code"]))
        assert entry.category != "unknown", row["code"]
        assert entry.name == row["mnemonic"].strip()
        assert entry.source
    assert CATALOG.codes() == list(range(1, 173))


@pytest.mark.parametrize(
    ("bucket", "action"),
    [("RESET_GPU", Action.RESET_GPU), ("RESTART_BM", Action.REBOOT_NODE), ("RESTART_APP", Action.OBSERVE),
     ("WORKFLOW_XID_48", Action.RESET_GPU), ("CHECK_MECHANICALS", Action.INSPECT_HARDWARE)],
)
def test_nvidia_buckets_map_consistently(bucket: str, action: Action) -> None:
    codes = [int(r["code"]) for r in nvidia_rows()
             if r["immediate_action"] == bucket and r["description"] != "Unused" and int(r["code"]) not in (63, 64)]
    assert codes
    assert {CATALOG.entry(c).action for c in codes} == {action}


def test_well_known_codes() -> None:
    assert CATALOG.entry(79).action is Action.REBOOT_NODE and CATALOG.entry(79).sticky
    assert CATALOG.entry(48).action is Action.RESET_GPU
    assert CATALOG.entry(95).action is Action.RESET_GPU and CATALOG.entry(95).sticky
    assert CATALOG.entry(119).action is Action.RESET_GPU
    for code in (13, 31, 43, 45, 68, 94):
        assert CATALOG.entry(code).category == "app"
        assert CATALOG.entry(code).action not in REMOVING_ACTIONS
    for code in (74, 79, 95, 109, 119):
        assert CATALOG.entry(code).sticky


def test_unknown_code_alerts_and_an_override_can_change_any_code() -> None:
    entry = CATALOG.entry(4242)
    assert (entry.code, entry.category, entry.action) == (4242, "unknown", Action.ALERT)
    custom = XidCatalog.default(overrides={4242: Action.DRAIN, 13: Action.ALERT}, unknown_action=Action.OBSERVE)
    assert custom.entry(4242).action is Action.DRAIN
    assert custom.entry(13).action is Action.ALERT and "override" in custom.entry(13).source
    assert custom.entry(4243).action is Action.OBSERVE
    (v,) = judge([XidOccurrence(4242, 900.0)], catalog=custom)
    assert v.action is Action.DRAIN


def test_unknown_code_never_drains_by_default() -> None:
    (v,) = judge([XidOccurrence(4242, 990.0, count=50)])
    assert v.action is Action.ALERT


def test_bad_catalog_row_is_a_clear_error() -> None:
    text = "code,name,description,action,category,sticky,source\n7,X,Y,explode,gpu,no,me\n"
    with pytest.raises(ValueError, match="row 1"):
        load_entries(text)


def test_single_fatal_xid_gets_the_catalog_action() -> None:
    (v,) = judge([XidOccurrence(79, 990.0, message="GPU has fallen off the bus.")])
    assert (v.action, v.codes, v.since, v.key) == (Action.REBOOT_NODE, (79,), 990.0, "xid:79")


def test_app_xid_alone_or_in_one_burst_does_not_remove_the_gpu() -> None:
    # gpud's real burst: 16 Xid 13 lines within 2 ms, then one Xid 43
    burst = [XidOccurrence(13, 900.0 + i * 0.0001) for i in range(16)] + [XidOccurrence(43, 900.004)]
    verdicts = judge(burst)
    assert {v.codes: v.action for v in verdicts} == {(13,): Action.OBSERVE, (43,): Action.OBSERVE}


def test_app_xid_repeating_in_separate_bursts_escalates() -> None:
    occs = [XidOccurrence(13, t) for t in (100.0, 400.0, 700.0)]
    (v,) = judge(occs)
    assert v.action is Action.DRAIN and v.key == "xid:13:repeat" and v.since == 100.0
    (below,) = judge(occs[:2])
    assert below.action is Action.OBSERVE


def test_app_repeats_outside_the_window_do_not_escalate() -> None:
    occs = [XidOccurrence(31, t) for t in (0.0, 3700.0, 7400.0)]
    (v,) = judge(occs, now=7500.0)
    assert v.action is Action.OBSERVE and v.since == 7400.0


def test_xid154_overrides_the_xid_it_accompanies() -> None:
    reset = "GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)"
    occs = [XidOccurrence(13, 900.0, message="Graphics Exception"), XidOccurrence(154, 900.5, message=reset)]
    verdicts = {v.key: v for v in judge(occs)}
    assert verdicts["xid:13"].action is Action.RESET_GPU and verdicts["xid:13"].codes == (13, 154)
    assert verdicts["xid:154"].action is Action.RESET_GPU


def test_xid154_node_reboot_and_drain_p2p() -> None:
    occs = [XidOccurrence(95, 900.0), XidOccurrence(154, 901.0, message="changed from 0x1 (GPU Reset Required) to "
                                                                          "0x2 (Node Reboot Required)")]
    v95 = next(v for v in judge(occs) if v.key == "xid:95")
    assert v95.action is Action.REBOOT_NODE
    assert recovery_action("GPU recovery action changed from 0x0 (None) to 0x4 (Drain P2P)") is Action.DRAIN
    assert recovery_action("changed from 0x1 (GPU Reset Required) to 0x0 (None)") is Action.OBSERVE
    assert recovery_action("something else") is None


def test_xid_after_the_last_154_is_judged_alone() -> None:
    occs = [XidOccurrence(154, 100.0, message="from 0x1 (GPU Reset Required) to 0x0 (None)"),
            XidOccurrence(79, 500.0)]
    v79 = next(v for v in judge(occs) if v.key == "xid:79")
    assert v79.action is Action.REBOOT_NODE


def test_unparsable_154_alerts() -> None:
    (v,) = judge([XidOccurrence(154, 990.0, message="GPU recovery action changed to something new")])
    assert v.action is Action.ALERT


@pytest.mark.parametrize(
    ("pending", "failure", "action"),
    [(False, True, Action.INSPECT_HARDWARE), (True, False, Action.RESET_GPU), (True, True, Action.INSPECT_HARDWARE),
     (False, False, Action.OBSERVE), (None, None, None)],
)
@pytest.mark.parametrize("code", [63, 64])
def test_row_remap_xids_defer_to_nvml_state(code: int, pending: bool | None, failure: bool | None,
                                            action: Action | None) -> None:
    (v,) = judge([XidOccurrence(code, 990.0)], pending=pending, failure=failure)
    assert v.action is (action or CATALOG.entry(code).action)


def test_sticky_flood_counts_once_and_keeps_its_since() -> None:
    flood = [XidOccurrence(95, 100.0 + i, count=27_000) for i in range(30)]  # 810k lines
    (v,) = judge(flood, now=200.0)
    assert v.action is Action.RESET_GPU and "counted once" in v.reason
    (again,) = judge(flood, now=900.0)
    assert (again.key, again.since) == (v.key, v.since) == ("xid:95", 100.0)


def test_episode_since_is_stable_across_reevaluation_and_resets_after_a_quiet_window() -> None:
    occs = [XidOccurrence(48, 100.0), XidOccurrence(48, 3000.0), XidOccurrence(48, 5000.0)]
    (v,) = judge(occs, now=5100.0)
    assert v.since == 100.0  # gaps < window: one episode
    occs.append(XidOccurrence(48, 9000.0))
    (later,) = judge(occs, now=9100.0)
    assert later.since == 9000.0  # a quiet window ended the first episode
    assert judge(occs, now=20000.0) == []


def test_nvlink5_severity_from_text() -> None:
    fatal = "RLW_REMAP Fatal XC1 i0 Link 10 (0x00000082 0x00000040 0x00000000 0x00000000 0x00000000 0x00000000)"
    assert occurrence_action(CATALOG, 145, fatal) is Action.RESET_GPU
    assert occurrence_action(CATALOG, 149, "NETIR_LINK_EVT  Non-fatal XC0 i0 Link 09 (0x0)") is Action.OBSERVE
    (v,) = judge([XidOccurrence(145, 990.0, message=fatal)])
    assert v.action is Action.RESET_GPU


def test_verdicts_are_sorted_strongest_first() -> None:
    verdicts = judge([XidOccurrence(13, 990.0), XidOccurrence(79, 991.0), XidOccurrence(92, 992.0)])
    assert [v.action for v in verdicts] == [Action.REBOOT_NODE, Action.ALERT, Action.OBSERVE]


def test_sxid_catalog_follows_the_fabric_manager_guide_and_the_line_word_wins() -> None:
    sxids = SxidCatalog.default()
    assert len(sxids.codes()) == 93
    # D.4 non-fatal, D.5 fatal, D.6 always fatal (Fabric Manager user guide DU-09883-001_v1.3).
    assert (sxids.entry(22013) or pytest.fail()).fm_class == "non_fatal"
    assert sxids.action(22013, None) == Action.OBSERVE
    assert sxids.action(24007, None) == Action.REBOOT_NODE
    assert sxids.action(12020, None) == Action.REBOOT_NODE
    assert sxids.action(12028, None) == Action.ALERT  # non-fatal, but a person must restart something
    assert sxids.action(26008, None) == Action.ALERT  # not in the guide: seen, not acted on
    assert sxids.action(24007, "Non-fatal") == Action.OBSERVE
    assert sxids.action(22013, "Fatal") == Action.REBOOT_NODE


def test_sxid_catalog_rejects_a_bad_row() -> None:
    with pytest.raises(ValueError, match=r"sxid_catalog.csv row 1"):
        load_sxid_entries("code,name,fm_class,action,rule\n1,x,non_fatal,nuke,r\n")

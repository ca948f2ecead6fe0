"""The decode of Xid 74 (NVIDIA's WORKFLOW_NVLINK_ERR register guide) and of the NVLink5 Xids
144-150 (NVIDIA's "Xid 144-150 Decode" sheet, both driver pattern generations): per register
pattern, on the recorded real lines, and the fallbacks when a line matches no row."""

from __future__ import annotations

from pathlib import Path

import pytest

from vigil.agent.kernel_log import KernelLogParser
from vigil.aggregator.decision import Action
from vigil.aggregator.xid_catalog import (
    NVLINK_RESOLUTION_ACTIONS,
    XID74_BENIGN,
    XID74_REGISTER_BITS,
    Nvlink5Row,
    XidCatalog,
    XidOccurrence,
    decode_nvlink,
    judge_xids,
    load_nvlink5_rows,
)

CATALOG = XidCatalog.default()
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "kernel-log"
ROWS = load_nvlink5_rows()
GENERATIONS = ("<R575", ">=R575")


def _intr(row: Nvlink5Row, generation: str, dont_care: int) -> int:
    """An intrInfo matching ``row``'s pattern of ``generation``, its free bits set to ``dont_care``."""
    mask, value = row.intr_masks[GENERATIONS.index(generation)]
    return value | (~mask & 0xFFFFFFFF & dont_care)


def _line(row: Nvlink5Row, intr: int, status: int, severity: str) -> str:
    return (f"{row.unit.split('/')[0]} {severity} XC0 i0 Link 07 (0x{intr:08x} 0x{status:08x} 0x00000000 "
            f"0x00000000 0x00000000 0x00000000)")


def test_the_sheet_is_whole() -> None:
    """Every code 144-150 has rows, every row a known resolution (95 rows as NVIDIA ships them)."""
    assert len(ROWS) == 95
    assert {r.code for r in ROWS} == set(range(144, 151))
    assert {r.resolution for r in ROWS} <= set(NVLINK_RESOLUTION_ACTIONS)


@pytest.mark.parametrize("generation", GENERATIONS)
@pytest.mark.parametrize("row", ROWS, ids=lambda r: f"{r.code}-{r.unit}-{sorted(r.statuses or [])}")
def test_every_row_of_the_decode_sheet_decodes_in_both_driver_generations(row: Nvlink5Row, generation: str) -> None:
    # Free bits all 0, then the top six (free in every pattern) set: neither may change the unit.
    for dont_care in (0, 0xFC000000):
        intr = _intr(row, generation, dont_care)
        for status in sorted(row.statuses or {0}):
            severity = "Non-fatal" if row.severity.lower().startswith("non") else "Fatal"
            decoded = decode_nvlink(CATALOG, row.code, _line(row, intr, status, severity))
            assert decoded is not None
            assert row.unit in (decoded.unit or "").split(" or ")
            assert generation in (decoded.driver or "").split(" or ")  # 150: both generations print zeros
            assert decoded.link == 7 and decoded.fatal is (severity == "Fatal")
            rows_here = [r for r in ROWS if r.code == row.code and r.intr_masks == row.intr_masks
                         and (r.statuses is None or status in r.statuses)]
            assert decoded.resolution in {r.resolution for r in rows_here}
            assert decoded.action is max((NVLINK_RESOLUTION_ACTIONS[r.resolution] for r in rows_here),
                                         key=list(Action).index)


# Hand-decoded real lines (tests/fixtures/kernel-log/PROVENANCE.md): (file, line number) ->
# (code, link, fatal, unit, driver generation, resolution, investigatory, action).
REAL = [
    ("nvsentinel-kernel-log-samples.txt", 1, 149, 9, True, "NETIR_LINK_EVT/NETIR_LINK_DOWN", "<R575", "RESET_GPU",
     "INVESTIGATE_PEER_DEVICE", Action.RESET_GPU),  # bits 25..20 = 100101
    ("nvsentinel-kernel-log-samples.txt", 8, 145, 10, True, "RLW_REMAP", "<R575", "RESET_GPU", "CONTACT_SUPPORT",
     Action.RESET_GPU),  # intrInfo low bits 0010000010, errorStatus 0x40
    ("gpud-pr1160-pr1174-nvlink5.log", 1, 144, 0, False, "SAW_MVB", ">=R575", "IGNORE", "CONTACT_SUPPORT",
     Action.OBSERVE),  # intrInfo 0000001 (R575+), errorStatus 0x8
    ("gpud-pr1160-pr1174-nvlink5.log", 2, 149, 0, True, "NETIR_LINK_EVT/NETIR_LINK_DOWN", "<R575", "IGNORE",
     "INVESTIGATE_SW/USER", Action.OBSERVE),  # bits 25..20 = 100110: NVIDIA says IGNORE
    ("gpud-pr1160-pr1174-nvlink5.log", 3, 149, 0, True, "NETIR_LINK_EVT/NETIR_LINK_DOWN", "<R575", "RESET_GPU",
     "INVESTIGATE_PEER_DEVICE", Action.RESET_GPU),
    ("gpud-pr1160-pr1174-nvlink5.log", 4, 149, None, True, "NETIR/NETIR_INT", "<R575", "RESET_GPU",
     "SYMPATHETIC_REPORT_SOLO", Action.RESET_GPU),  # "Link -1": the unit, no link
    ("gpud-pr1160-pr1174-nvlink5.log", 5, 145, 13, False, "RLW_RXPIPE", "<R575", "IGNORE", "CONTACT_SUPPORT",
     Action.OBSERVE),
    ("gpud-xid-test-gb200-netir-154.log", 6, 149, 15, True, "NETIR_LINK_EVT/NETIR_LINK_DOWN", "<R575", "RESET_GPU",
     "INVESTIGATE_PEER_DEVICE", Action.RESET_GPU),  # bits 25..20 = 100001
]


def _event(file: str, number: int):  # type: ignore[no-untyped-def]
    parser = KernelLogParser()
    line = (FIXTURES / file).read_text(encoding="utf-8").splitlines()[number - 1]
    event = parser.feed(line).event
    assert event is not None and event.kind == "xid"
    return event


@pytest.mark.parametrize(("file", "number", "code", "link", "fatal", "unit", "driver", "resolution", "investigatory",
                          "action"), REAL, ids=[f"{r[0]}:{r[1]}" for r in REAL])
def test_recorded_real_nvlink5_lines_decode(file: str, number: int, code: int, link: int | None, fatal: bool, unit: str,
                                            driver: str, resolution: str, investigatory: str, action: Action) -> None:
    event = _event(file, number)
    assert event.code == code
    decoded = decode_nvlink(CATALOG, code, event.text)
    assert decoded is not None
    assert (decoded.link, decoded.fatal, decoded.unit, decoded.driver) == (link, fatal, unit, driver)
    assert (decoded.resolution, decoded.investigatory, decoded.action) == (resolution, investigatory, action)


# Xid 74 ------------------------------------------------------------------------------------------

GUIDE_BITS = [(reg, bit, cls) for reg, bits in XID74_REGISTER_BITS.items() for bit, cls in bits.items()]


def _xid74(link: int, regs: list[int]) -> str:
    return f"NVLink: fatal error detected on link {link}({', '.join(hex(r) for r in regs)})"


@pytest.mark.parametrize(("reg", "bit", "cls"), GUIDE_BITS, ids=[f"reg{r}-bit{b}-{c}" for r, b, c in GUIDE_BITS])
def test_every_xid74_register_bit_of_the_guide(reg: int, bit: int, cls: str) -> None:
    regs = [0] * 7
    regs[reg - 1] = 1 << bit
    decoded = decode_nvlink(CATALOG, 74, _xid74(3, regs))
    assert decoded is not None
    assert decoded.link == 3 and decoded.fatal and decoded.resolution == "WORKFLOW_NVLINK_ERR"
    assert decoded.bits == (f"reg{reg}.bit{bit}={cls}",)
    assert decoded.action is (Action.OBSERVE if cls in XID74_BENIGN else Action.RESET_GPU)


def test_recorded_real_xid74_lines_decode() -> None:
    # NVSentinel's sample / design doc: third register bit 16 ("if seen repeatedly, run Field Diags").
    for file, number in (("nvsentinel-kernel-log-samples.txt", 4), ("nvsentinel-doc022-xid74.log", 1)):
        decoded = decode_nvlink(CATALOG, 74, _event(file, number).text)
        assert decoded is not None
        assert decoded.link == 14 and decoded.registers == (0, 0, 0x10000, 0, 0, 0, 0)
        assert decoded.bits == ("reg3.bit16=diags_if_repeated",) and decoded.action is Action.RESET_GPU
    # SageMaker HyperPod's documented injection: first register bit 16 (possible HW issue).
    decoded = decode_nvlink(CATALOG, 74, _event("hyperpod-doc-xid74-injected.log", 1).text)
    assert decoded is not None and decoded.link == 6
    assert decoded.bits == ("reg1.bit16=hardware",) and decoded.action is Action.RESET_GPU


def test_xid74_lookalikes_and_fallbacks() -> None:
    only_benign = decode_nvlink(CATALOG, 74, _xid74(2, [1 | 1 << 23, 0, 0, 0, 1 << 20, 0, 0]))
    assert only_benign is not None and only_benign.action is Action.OBSERVE  # ignore + ECC threshold only
    mixed = decode_nvlink(CATALOG, 74, _xid74(2, [1, 0, 0, 0, 1 << 18, 0, 0]))
    assert mixed is not None and mixed.action is Action.RESET_GPU  # ECC/parity beside an ignorable bit
    unlisted = decode_nvlink(CATALOG, 74, _xid74(2, [0, 1, 0, 0, 0, 0, 0]))  # 2nd register: not valid on Hopper
    assert unlisted is not None and unlisted.bits == ("reg2.bit0=unlisted",) and unlisted.action is Action.RESET_GPU
    bare = decode_nvlink(CATALOG, 74, "NVLink: fatal error detected on link 6")  # older drivers: no registers
    assert bare is not None and bare.link == 6 and bare.resolution is None and bare.action is Action.RESET_GPU


# NVLink5 fallbacks and judging ------------------------------------------------------------------

def test_nvlink5_line_matching_no_row_follows_its_severity_word() -> None:
    fatal = decode_nvlink(CATALOG, 145, "RLW_NEW Fatal XC0 i0 Link 02 (0x000003ff 0x00000001 0x0 0x0 0x0 0x0)")
    assert fatal is not None and fatal.unit is None and fatal.resolution is None and fatal.action is Action.RESET_GPU
    quiet = decode_nvlink(CATALOG, 145, "RLW_NEW Non-fatal XC0 i0 Link 02 (0x000003ff 0x00000001 0x0 0x0 0x0 0x0)")
    assert quiet is not None and quiet.action is Action.OBSERVE
    # The unit is known but not its errorStatus bit: unit named, resolution undecoded, word decides.
    odd = decode_nvlink(CATALOG, 145, "RLW_REMAP Fatal XC0 i0 Link 02 (0x00000082 0x00004000 0x0 0x0 0x0 0x0)")
    assert odd is not None and odd.unit == "RLW_REMAP" and odd.resolution is None and odd.action is Action.RESET_GPU


def test_several_error_status_bits_take_the_strongest_row() -> None:
    # RLW_REMAP 0x01 (XID_154_EVAL) together with 0x40 (RESET_GPU).
    decoded = decode_nvlink(CATALOG, 145, "RLW_REMAP Fatal XC0 i0 Link 02 (0x00000082 0x00000041 0x0 0x0 0x0 0x0)")
    assert decoded is not None and decoded.resolution == "RESET_GPU" and decoded.action is Action.RESET_GPU


def test_an_operator_override_is_final() -> None:
    catalog = XidCatalog.default(overrides={145: Action.ALERT})
    line = "RLW_REMAP Fatal XC1 i0 Link 10 (0x00000082 0x00000040 0x0 0x0 0x0 0x0)"
    assert decode_nvlink(catalog, 145, line) is None
    (v,) = judge_xids(catalog, [XidOccurrence(145, 10.0, message=line)], remap_pending=None, remap_failure=None,
                      now=20.0, window_seconds=3600.0, app_repeat_threshold=3)
    assert v.action is Action.ALERT


def test_a_later_non_fatal_line_does_not_undo_a_fatal_one() -> None:
    fatal = "RLW_REMAP Fatal XC1 i0 Link 10 (0x00000082 0x00000040 0x0 0x0 0x0 0x0)"
    nonfatal = "RLW_RXPIPE Nonfatal XC0 i0 Link 13 (0x0409a0c2 0x00000008 0x1 0x0 0x00100000 0x4)"
    (v,) = judge_xids(CATALOG, [XidOccurrence(145, 10.0, message=fatal), XidOccurrence(145, 12.0, message=nonfatal)],
                      remap_pending=None, remap_failure=None, now=20.0, window_seconds=3600.0, app_repeat_threshold=3)
    assert v.action is Action.RESET_GPU and v.nvlink is not None and v.nvlink.link == 10
    (quiet,) = judge_xids(CATALOG, [XidOccurrence(145, 12.0, message=nonfatal)], remap_pending=None,
                          remap_failure=None, now=20.0, window_seconds=3600.0, app_repeat_threshold=3)
    assert quiet.action is Action.OBSERVE and "unit RLW_RXPIPE" in quiet.reason


def test_xid_154_eval_rows_follow_a_companion_xid_154() -> None:
    line = "RLW_REMAP Non-fatal XC0 i0 Link 04 (0x00000082 0x00000004 0x0 0x0 0x0 0x0)"  # XID_154_EVAL
    alone = judge_xids(CATALOG, [XidOccurrence(145, 10.0, message=line)], remap_pending=None, remap_failure=None,
                       now=20.0, window_seconds=3600.0, app_repeat_threshold=3)
    assert [v.action for v in alone] == [Action.OBSERVE]
    with154 = judge_xids(CATALOG, [XidOccurrence(145, 10.0, message=line), XidOccurrence(
        154, 10.5, message="GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)")],
        remap_pending=None, remap_failure=None, now=20.0, window_seconds=3600.0, app_repeat_threshold=3)
    assert {v.codes: v.action for v in with154}[(145, 154)] is Action.RESET_GPU

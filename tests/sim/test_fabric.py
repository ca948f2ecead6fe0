"""The simulated HCA tree looks like a real ConnectX-7 node's and port faults show as the kernel shows them."""

from __future__ import annotations

from pathlib import Path

from vigil.sim.fabric import NodeFabric, build_tree

REAL = Path(__file__).resolve().parent.parent / "fixtures" / "sim" / "ib-mlx5_0"


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def test_layout_and_formats_match_a_real_node(tmp_path: Path) -> None:
    root = build_tree(tmp_path, 2)
    ours = root / "class" / "infiniband" / "mlx5_0"
    assert _files(ours) == _files(REAL)
    for name in ("hca_type", "fw_ver", "board_id", "ports/1/state", "ports/1/phys_state", "ports/1/rate",
                 "ports/1/link_layer"):
        # the recording lost its trailing newlines; the kernel writes one, and so do we
        assert (ours / name).read_text().strip() == (REAL / name).read_text().strip(), name
    assert (root / "class" / "infiniband" / "mlx5_1" / "ports" / "1" / "counters" / "symbol_error").exists()


def test_link_down_counts_once_and_counters_saturate(tmp_path: Path) -> None:
    fab = NodeFabric(build_tree(tmp_path, 1))
    port = tmp_path / "class" / "infiniband" / "mlx5_0" / "ports" / "1"
    fab.set_link(0, False)
    fab.set_link(0, False)  # already down: not a second transition
    assert (port / "state").read_text() == "1: DOWN\n"
    assert (port / "counters" / "link_downed").read_text() == "1\n"
    fab.set_link(0, True)
    assert (port / "phys_state").read_text() == "5: LinkUp\n"
    fab.add_counter(0, "link_error_recovery", 1000)
    fab.add_counter(0, "port_xmit_data", 1000)
    assert (port / "counters" / "link_error_recovery").read_text() == "255\n"
    assert (port / "counters" / "port_xmit_data").read_text() == "1000\n"

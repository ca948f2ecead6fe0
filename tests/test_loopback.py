"""tests/loopback.py under pytest-xdist: each worker's ports come from a slice of the range no
other worker draws from, and a process outside xdist draws from all of it."""

from __future__ import annotations

from tests.loopback import _slice


def test_workers_draw_from_disjoint_slices_within_the_range() -> None:
    for count in (1, 2, 3, 4, 7, 16):
        slices = [_slice(20000, 32000, {"PYTEST_XDIST_WORKER": f"gw{i}", "PYTEST_XDIST_WORKER_COUNT": str(count)})
                  for i in range(count)]
        ports = [set(range(low, high)) for low, high in slices]
        assert all(len(p) >= 12000 // count - 1 for p in ports)
        assert set().union(*ports) <= set(range(20000, 32000))
        assert sum(map(len, ports)) == len(set().union(*ports))  # no port in two slices


def test_outside_xdist_or_on_a_malformed_worker_name_the_whole_range() -> None:
    assert _slice(20000, 32000, {}) == (20000, 32000)
    assert _slice(20000, 32000, {"PYTEST_XDIST_WORKER": "master", "PYTEST_XDIST_WORKER_COUNT": "2"}) == (20000, 32000)
    assert _slice(20000, 32000, {"PYTEST_XDIST_WORKER": "gw5", "PYTEST_XDIST_WORKER_COUNT": "2"}) == (20000, 32000)

"""Group testing for fault isolation (issue 39): tests ``GroupIsolation`` uses to find d faulty nodes
among 232, against the information bound log2 C(232, d) and the issue's target of 1.2x that bound.

Each row runs PLACEMENTS random placements of d faulty nodes on a fleet of 232 nodes, 16 to a leaf,
under the OR model with no noise (a test fails iff a member is faulty), and reports the mean tests
(max in the note, with the rounds: batches of concurrent tests, the time a run takes in probes).
Every count includes the confirmations alone and the test of the rest that unknown d costs.
It asserts nothing: it prints figures beside their budgets.
"""

from __future__ import annotations

import random
import statistics
import sys

from bench.measure import Measurement
from vigil.aggregator.group_testing import GroupIsolation, information_bound

NODES = 232  # the figure: NVIDIA's cluster readiness engine, 232 nodes
LEAF_SIZE = 16
PLACEMENTS = 500
TARGET_RATIO = 1.2  # issue 39: tests within 1.2x the information bound
PAIRWISE = NODES * (NODES - 1) // 2  # 26,796: every pair tested once (check-nccl style)

# (faulty nodes, d_hint): the hint right, then the hint wrong both ways.
ROWS: tuple[tuple[int, int], ...] = ((1, 1), (3, 3), (5, 5), (3, 1), (5, 1), (0, 1), (0, 0))


def run_once(d: int, d_hint: int, seed: int) -> tuple[int, int, int, int]:
    """One placement: (tests, rounds, confirmations, tests of the rest)."""
    rng = random.Random(seed)
    nodes = [f"node{i:03d}" for i in range(NODES)]
    leaf_of = {x: f"leaf{i // LEAF_SIZE:02d}" for i, x in enumerate(nodes)}
    bad = set(rng.sample(nodes, d))
    g = GroupIsolation(nodes, ["healthy0"], d_hint, leaf_of)
    rounds = 0
    while not g.done:
        rounds += 1
        for t in g.next_tests():
            g.record(t, not (set(t.members) & bad))
    if g.faulty != bad:
        raise AssertionError(f"d={d} d_hint={d_hint} seed={seed}: found {sorted(g.faulty)}, placed {sorted(bad)}")
    return g.tests_used, rounds, g.confirmation_tests, g.remainder_tests


def measure() -> list[Measurement]:
    out = [Measurement(f"group testing: pairwise tests for {NODES} nodes (scale)", PAIRWISE, "tests", None)]
    for d, d_hint in ROWS:
        runs = [run_once(d, d_hint, seed) for seed in range(PLACEMENTS)]
        tests = [r[0] for r in runs]
        mean = statistics.mean(tests)
        bound = information_bound(NODES, d)
        hint = "d known to the hint" if d == d_hint else f"d unknown: d_hint={d_hint}"
        ratio = f"{mean / bound:.3f}x the bound {bound:.2f}" if d else "bound 0"
        note = (f"{ratio}; max {max(tests)}, rounds mean {statistics.mean(r[1] for r in runs):.1f}; "
                f"of the mean, {statistics.mean(r[2] for r in runs):.2f} confirmations alone and "
                f"{statistics.mean(r[3] for r in runs):.2f} tests of the rest; {PLACEMENTS} placements, "
                f"{LEAF_SIZE} nodes a leaf")
        out.append(Measurement(f"group testing: tests to isolate d={d} of {NODES} ({hint})", mean, "tests",
                               TARGET_RATIO * bound if d else 1.0, note=note))
    return out


if __name__ == "__main__":
    for m in measure():
        ok = {True: "ok", False: "OVER", None: "-"}[m.within_budget]
        budget = "-" if m.budget is None else f"{m.budget:.2f}"
        print(f"{m.what:70s} {m.value:>9.2f} {m.unit:5s} budget {budget:>6}  {ok}  {m.note}")
    sys.exit(0)

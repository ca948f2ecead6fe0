"""Group testing for fault isolation: the exact faulty set for many placements, d at, above and below
the hint; tests within a leaf before across leaves; a single node tested with a healthy partner;
concurrent tests disjoint; the algorithm's own bound on tests; confirmation and retests under noise."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest

from vigil.aggregator.group_testing import GroupIsolation, GroupTest, information_bound, worst_case_tests

LEAF_SIZE = 16


def fleet(n: int, seed: int = 0) -> tuple[list[str], dict[str, str]]:
    """n nodes, LEAF_SIZE to a leaf, handed over in a shuffled order (the order must not matter)."""
    nodes = [f"node{i:03d}" for i in range(n)]
    leaf_of = {x: f"leaf{i // LEAF_SIZE:02d}" for i, x in enumerate(nodes)}
    leaf_of["healthy0"] = "leaf00"
    random.Random(seed).shuffle(nodes)
    return nodes, leaf_of


def drive(g: GroupIsolation, passes: Callable[[GroupTest], bool]) -> list[list[GroupTest]]:
    """Run every batch ``next_tests`` hands out until done; each batch checked disjoint."""
    batches: list[list[GroupTest]] = []
    while not g.done:
        batch = g.next_tests()
        assert batch, "not done, yet nothing to test and nothing outstanding"
        nodes = [x for t in batch for x in t.nodes]
        assert len(nodes) == len(set(nodes)), f"concurrent tests share a node: {batch}"
        for t in batch:
            assert t.partner is None if len(t.members) > 1 else t.partner is not None
            g.record(t, passes(t))
        batches.append(batch)
        assert len(batches) < 10_000
    return batches


def or_model(bad: set[str]) -> Callable[[GroupTest], bool]:
    return lambda t: not (set(t.nodes) & bad)


@pytest.mark.parametrize("d", [0, 1, 2, 3, 5, 8])
@pytest.mark.parametrize("hint", ["exact", 0, 1, 4])
def test_finds_exactly_the_faulty_set_within_its_bound(d: int, hint: int | str) -> None:
    for n in (1, 7, 64, 232):
        for seed in range(40 if n == 232 else 25):
            if d > n:
                continue
            nodes, leaf_of = fleet(n, seed)
            bad = set(random.Random(1000 + seed).sample(nodes, d))
            d_hint = d if hint == "exact" else int(hint)
            g = GroupIsolation(nodes, ["healthy0"], d_hint, leaf_of)
            drive(g, or_model(bad))
            assert g.faulty == bad, (n, d, d_hint, seed)
            assert g.cleared == set(nodes) - bad
            assert g.tests_used <= worst_case_tests(n, d, d_hint), (n, d, d_hint, seed, g.tests_used)
            assert g.confirmation_tests <= d
            assert g.remainder_tests <= 1 + max(0, d - d_hint)
            assert g.retests == 0
            if d == d_hint:  # Hwang's part (the rest: confirmations and the one test of the rest)
                core = g.tests_used - g.confirmation_tests - g.remainder_tests
                assert core <= math.ceil(information_bound(n, d)) + d


def test_no_faulty_node_with_hint_zero_costs_one_test() -> None:
    nodes, leaf_of = fleet(232)
    g = GroupIsolation(nodes, ["healthy0"], 0, leaf_of)
    batches = drive(g, or_model(set()))
    assert g.tests_used == 1 and len(batches) == 1 and set(batches[0][0].members) == set(nodes)
    assert g.faulty == frozenset() and g.cleared == set(nodes)


def test_no_faulty_node_with_hint_one_clears_everyone() -> None:
    nodes, leaf_of = fleet(232)
    g = GroupIsolation(nodes, ["healthy0"], 1, leaf_of)
    batches = drive(g, or_model(set()))
    # The groups sized for one faulty node (128, 64, 16, 16, 4, 2, 1, 1) all pass: the price of a
    # hint above the truth; the last single nodes are tested with the partner.
    assert [len(t.members) for b in batches for t in b] == [128, 64, 16, 16, 4, 2, 1, 1]
    assert g.faulty == frozenset() and g.cleared == set(nodes)


def test_every_faulty_node_failed_a_test_alone_with_a_healthy_partner() -> None:
    for seed in range(60):
        nodes, leaf_of = fleet(100, seed)
        bad = set(random.Random(seed).sample(nodes, 3))
        g = GroupIsolation(nodes, ["healthy0"], 3, leaf_of)
        alone_failed: set[str] = set()
        cleared_when: set[str] = set()

        def passes(
            t: GroupTest, bad: set[str] = bad, alone_failed: set[str] = alone_failed, cleared: set[str] = cleared_when
        ) -> bool:
            ok = not (set(t.members) & bad)
            if len(t.members) == 1:
                # The partner is known healthy: given, or cleared by a test that passed before.
                assert t.partner == "healthy0" or t.partner in cleared
                if not ok:
                    alone_failed.add(t.members[0])
            if ok:
                cleared.update(t.members)
            return ok

        drive(g, passes)
        assert g.faulty == bad and alone_failed == bad


def test_an_inferred_node_is_confirmed_alone_and_a_single_suspect_with_its_partner() -> None:
    # Four nodes, one faulty, b: {a, b} fails; the halving's last step tests a alone (with the
    # partner); a passes, so b is only inferred and is confirmed by a test of its own with the
    # partner; then the rest, {c, d}, in one test (d is not known).
    g = GroupIsolation(list("abcd"), ["h"], 1)
    steps = [(GroupTest(("a", "b")), False), (GroupTest(("a",), "h"), True), (GroupTest(("b",), "h"), False),
             (GroupTest(("c", "d")), True)]
    for test, passed in steps:
        assert not g.done and g.next_tests() == [test]
        g.record(test, passed)
    assert g.done and g.faulty == {"b"} and g.cleared == {"a", "c", "d"}
    assert (g.tests_used, g.confirmation_tests, g.remainder_tests) == (4, 1, 1)
    # a faulty: its failed test alone is the halving's last step: no confirmation more.
    g = GroupIsolation(list("abcd"), ["h"], 1)
    drive(g, or_model({"a"}))
    assert g.faulty == {"a"} and (g.tests_used, g.confirmation_tests) == (3, 0)  # ab, a alone, bcd


def test_one_suspect_is_tested_with_a_partner_of_its_own_leaf() -> None:
    leaf_of = {"s": "L2", "h1": "L1", "h2": "L2"}
    g = GroupIsolation(["s"], ["h1", "h2"], 1, leaf_of)
    assert g.next_tests() == [GroupTest(("s",), "h2")]


def test_groups_stay_within_a_leaf_before_spanning_leaves() -> None:
    # 232 nodes, 16 to a leaf, one faulty node: every group of at most a leaf's size lies within one
    # leaf and every larger group is whole leaves (but the last test: the rest, once the faulty one is found).
    for seed in range(40):
        nodes, leaf_of = fleet(232, seed)
        bad = {random.Random(seed).choice(nodes)}
        g = GroupIsolation(nodes, ["healthy0"], 1, leaf_of)
        seen = [t for batch in drive(g, or_model(bad)) for t in batch]
        assert g.remainder_tests <= 1 and g.faulty == bad
        for t in seen[: len(seen) - g.remainder_tests]:
            leaves = {leaf_of[x] for x in t.members}
            if len(t.members) <= LEAF_SIZE:
                assert len(leaves) == 1, t
            else:
                assert all(sum(leaf_of[x] == leaf for x in t.members) == LEAF_SIZE for leaf in leaves), t


def test_a_leaf_that_holds_enough_is_taken_before_groups_span_leaves() -> None:
    # 11 nodes, d_hint 2: Hwang's groups are of 4, two at once. Leaf A holds 5, leaf B 6: each group
    # comes from one leaf (the smallest that holds enough first), none from both.
    leaf_of = {**{f"a{i}": "A" for i in range(5)}, **{f"b{i}": "B" for i in range(6)}, "h": "A"}
    g = GroupIsolation([f"b{i}" for i in range(6)] + [f"a{i}" for i in range(5)], ["h"], 2, leaf_of)
    assert [set(t.members) for t in g.next_tests()] == [{f"a{i}" for i in range(4)}, {f"b{i}" for i in range(4)}]
    # Leaves of 3 and 3, a group of 4: it spans the two, whole leaf first.
    leaf_of = {**{f"a{i}": "A" for i in range(3)}, **{f"b{i}": "B" for i in range(3)}, "h": "A"}
    g = GroupIsolation([f"a{i}" for i in range(3)] + [f"b{i}" for i in range(3)], ["h"], 1, leaf_of)
    assert g.next_tests() == [GroupTest(("a0", "a1", "a2", "b0"))]


def test_concurrent_tests_are_disjoint_and_searches_run_side_by_side() -> None:
    nodes, leaf_of = fleet(232, 3)
    bad = set(random.Random(3).sample(nodes, 5))
    g = GroupIsolation(nodes, ["healthy0", "h1", "h2"], 5, leaf_of)
    batches = drive(g, or_model(bad))  # drive() asserts each batch disjoint
    assert max(len(b) for b in batches) >= 3
    assert len(batches) < g.tests_used / 2  # side by side, not one after another
    assert g.faulty == bad


def test_a_test_is_handed_out_once_and_recorded_once() -> None:
    g = GroupIsolation(["a", "b", "c", "d"], ["h"], 1)
    (t,) = g.next_tests()
    assert g.next_tests() == []  # waiting on t's result
    with pytest.raises(TypeError):
        g.record(t, "failed")  # type: ignore[arg-type]
    g.record(t, True)
    with pytest.raises(ValueError, match="not a test handed out"):
        g.record(t, True)
    with pytest.raises(ValueError, match="not a test handed out"):
        g.record(GroupTest(("a",), "h"), False)
    assert g.tests_used == 1 and g.cleared == set(t.members)


@pytest.mark.parametrize(
    ("nodes", "healthy", "d_hint", "leaf_of", "match"),
    [
        (["a", "a"], ["h"], 1, None, "repeat"),
        (["a", "h"], ["h"], 1, None, "both suspect and known healthy"),
        (["a"], [], 1, None, "healthy is empty"),
        (["a"], ["h"], -1, None, "must be >= 0"),
        (["a", "b"], ["h"], 1, {"a": "L"}, "no leaf for"),
    ],
)
def test_refuses_inputs_it_cannot_honour(
    nodes: list[str], healthy: list[str], d_hint: int, leaf_of: dict[str, str] | None, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        GroupIsolation(nodes, healthy, d_hint, leaf_of)


def test_no_nodes_is_done_at_once() -> None:
    g = GroupIsolation([], [], 0)
    assert g.done and g.next_tests() == [] and g.tests_used == 0


def test_a_false_group_failure_clears_everyone_and_a_false_failure_alone_is_retested() -> None:
    # Noise: the first test of a group fails for a reason outside it (a slow spine, say). The
    # halving finds no one; the node it is left with passes alone and is cleared, not declared.
    nodes, leaf_of = fleet(64)
    first: list[GroupTest] = []

    def noisy(t: GroupTest) -> bool:
        if not first:
            first.append(t)
            return False
        return True

    g = GroupIsolation(nodes, ["healthy0"], 1, leaf_of)
    drive(g, noisy)
    assert g.faulty == frozenset() and g.cleared == set(nodes)
    # With retest_failures=1 a node is declared only after two failures alone: a's noisy failure
    # alone is retested and a cleared; the really faulty b costs one retest more.
    bad = {"b"}
    alone_failures: set[str] = set()

    def noisy_alone(t: GroupTest) -> bool:
        x = t.members[0]
        if len(t.members) == 1 and x not in bad and x not in alone_failures:
            alone_failures.add(x)
            return False
        return not (set(t.members) & bad)

    g = GroupIsolation(["a", "b"], ["h"], 1, retest_failures=1)
    drive(g, noisy_alone)
    assert alone_failures == {"a"}
    assert g.faulty == bad and g.cleared == {"a"}
    assert (g.tests_used, g.retests) == (4, 2)  # a alone, a again, b alone, b again
    # The lookalike without retests: the same noise declares the healthy a faulty.
    alone_failures.clear()
    g = GroupIsolation(["a", "b"], ["h"], 1)
    drive(g, noisy_alone)
    assert alone_failures == {"a"} and g.faulty == {"a", "b"}


def test_information_bound() -> None:
    assert information_bound(232, 0) == 0
    assert information_bound(232, 1) == pytest.approx(math.log2(232))
    assert information_bound(232, 3) == pytest.approx(math.log2(232 * 231 * 230 / 6))
    with pytest.raises(ValueError):
        information_bound(3, 4)

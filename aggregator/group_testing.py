"""Group testing for fault isolation: which of N idle suspects are faulty, from collective probes over groups.

It reads the outcome of each group test the caller ran (a collective probe over a group of nodes,
which fails when any member is faulty: the OR model) and decides the next tests, then the faulty set
(every member of it failed a test alone with a known-healthy partner) and the cleared set. It is
pure: it runs no probe, keeps no clock and does no I/O; the prober owns the probes, their deadlines
and what a result means for a node.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache

# Up to this many nodes, one faulty node left is searched for with sizes from an exact program
# (``_one_left``, O(n^2) to build) instead of Hwang's powers of two; beyond it, Hwang's sizes.
ONE_LEFT_PROGRAM_NODES_MAX = 1024


@dataclass(frozen=True)
class GroupTest:
    """One collective probe: it fails when any member is faulty.

    A single node cannot run a collective alone: it is tested with ``partner``, a node known to be
    healthy (one of ``healthy`` or a node an earlier test cleared), so the test is that node's own.
    ``partner`` is None for groups of two or more.
    """

    members: tuple[str, ...]
    partner: str | None = None

    @property
    def nodes(self) -> tuple[str, ...]:
        """Every node the probe runs on (the members and the partner)."""
        return self.members if self.partner is None else (*self.members, self.partner)


def information_bound(n: int, d: int) -> float:
    """log2 C(n, d): the fewest tests, in the worst case, that tell which d of n are faulty."""
    if not 0 <= d <= n:
        raise ValueError(f"need 0 <= d <= n, got n={n}, d={d}")
    return math.log2(math.comb(n, d))


def worst_case_tests(n: int, d: int, d_hint: int) -> int:
    """The most tests ``GroupIsolation`` uses for d faulty among n with ``d_hint`` (its tests hold it to this).

    Hwang's splitting sized for h = min(d_hint, n), each failing group's own test counted (d is not
    known, so no test is skipped as sure to fail): ceil(log2 C(n, h)) + h; then at most d
    confirmations alone, one test of the rest once h are found, and per faulty node beyond the
    hint one more test of the rest and a halving of at most ceil(log2 n) tests.
    """
    h = min(d_hint, n)
    beyond = max(0, d - d_hint)
    return math.ceil(information_bound(n, h)) + h + d + 1 + beyond * (1 + math.ceil(math.log2(max(n, 2))))


@dataclass
class _Search:
    """Nodes a failed test says hold at least one faulty node; halved until one node is left."""

    members: tuple[str, ...]
    testing: bool = False


class GroupIsolation:
    """Hwang's generalized binary splitting, topology-aware, with unknown d and confirmation alone.

    Algorithm (F. K. Hwang, "A method for detecting all defective members in a population by group
    testing", JASA 67(339), 1972): with n undecided nodes and d faulty ones expected, if n <= 2d - 2
    test each node alone; otherwise test a group of 2**a nodes, a = floor(log2((n - d + 1) / d)).
    A group that passes is cleared; one that fails is halved (test one half: it passes, the fault is
    in the other; it fails, search in it and return the other half undecided) down to one node. With
    d known Hwang bounds it by log2 C(n, d) + d - 1 tests; counting each failing group's own test
    (with d unknown none is sure to fail) it stays within ceil(log2 C(n, d)) + d (``worst_case_tests``).

    What this adds:
    - Topology: nodes are ordered by leaf (``leaf_of``); a group, and each half of a failing group,
      is taken from one leaf when one leaf holds enough undecided nodes (the smallest such leaf),
      otherwise from the fewest leaves (the fullest first), so tests stay within a leaf before they
      span leaves.
    - Confirmation: the halving's last step tests one node alone with a known-healthy partner; when
      that fails, the node is confirmed with no extra test. When it passes, the other node is only
      inferred, and is confirmed by a test alone (``confirmation_tests``: about d/2 on average, at
      most d). A node is declared faulty only after failing alone; a test alone that passes clears
      it (a search that ends so was started by a false failure).
    - One faulty node expected (d_hint 1): the group sizes come from an exact program over the
      expected tests (``_one_left_tables``: its halving, confirmation and the test of the rest
      counted) instead of 2**floor(log2 n): 9.42 tests mean for 232 nodes where Hwang's sizes take
      9.49 (bench/bench_group_testing.py); of equal sizes, the one most aligned to leaves.
    - Unknown d: ``d_hint`` is an estimate. Fewer faulty nodes than hinted: the groups are smaller
      than ideal (Hwang's sizing for d_hint) and the run ends when every node is cleared. Once
      d_hint are found (or being searched), the rest is tested as one group (1 test, the price of
      not knowing d); when it fails, its search finds one more and the rest is tested again: each
      faulty node beyond the hint costs 1 + ceil(log2 r) tests (r: the undecided nodes then) plus
      its confirmation, about twice Hwang's cost for it when d is far above the hint.
    - Concurrency: ``next_tests`` returns every test that can start now (the next half of each
      search, up to d_hint - found - searching new groups), pairwise disjoint, partners included.
    - Noise: a pass is trusted (a faulty member fails the probe); a failure may be noise (a
      collective slowed by something outside the group). A false group failure costs its halving
      (about log2 of its size) and clears everyone; with ``retest_failures=k`` a node is declared
      faulty only after k + 1 failed tests alone (``retests``: k per faulty node, plus one per
      false failure alone).
    """

    def __init__(
        self,
        nodes: Sequence[str],
        healthy: Sequence[str],
        d_hint: int,
        leaf_of: Mapping[str, str] | None = None,
        *,
        retest_failures: int = 0,
    ) -> None:
        if len(set(nodes)) != len(nodes):
            raise ValueError("nodes repeat")
        if set(nodes) & set(healthy):
            raise ValueError(f"nodes both suspect and known healthy: {sorted(set(nodes) & set(healthy))[:5]}")
        if nodes and not healthy:
            raise ValueError("a test alone needs a known-healthy partner: healthy is empty")
        if d_hint < 0 or retest_failures < 0:
            raise ValueError(f"d_hint ({d_hint}) and retest_failures ({retest_failures}) must be >= 0")
        missing = [x for x in nodes if leaf_of is not None and x not in leaf_of]
        if missing:
            raise ValueError(f"no leaf for {missing[:5]}")
        self._leaf_of: Mapping[str, str] = leaf_of or {}
        self._healthy = tuple(dict.fromkeys(healthy))
        # Leaf order, then the caller's order within a leaf: runs of the order are within a leaf.
        self._order = sorted(nodes, key=lambda x: self._leaf_of.get(x, ""))
        self._rank = {x: i for i, x in enumerate(self._order)}
        self._d_hint = d_hint
        self._retest_failures = retest_failures
        self._undecided: set[str] = set(nodes)  # not cleared, not faulty, in no search, in no test
        self._searches: list[_Search] = []
        self._outstanding: dict[GroupTest, _Search | None] = {}
        self._failed_alone: dict[str, int] = {}
        self._faulty: set[str] = set()
        self._cleared: set[str] = set()
        self._tests_used = 0
        self._confirmation_tests = 0
        self._retests = 0
        self._remainder_tests = 0

    # -- what the caller reads -------------------------------------------------------------------

    @property
    def done(self) -> bool:
        return not (self._undecided or self._searches or self._outstanding)

    @property
    def faulty(self) -> frozenset[str]:
        return frozenset(self._faulty)

    @property
    def cleared(self) -> frozenset[str]:
        return frozenset(self._cleared)

    @property
    def tests_used(self) -> int:
        """Tests recorded, confirmations and retests included."""
        return self._tests_used

    @property
    def confirmation_tests(self) -> int:
        """Tests alone of a node only inferred faulty (the halving never tested it alone)."""
        return self._confirmation_tests

    @property
    def retests(self) -> int:
        """Tests alone repeated after a failure alone (``retest_failures``)."""
        return self._retests

    @property
    def remainder_tests(self) -> int:
        """Tests of every undecided node as one group once d_hint were found (d is not known)."""
        return self._remainder_tests

    # -- the two calls ---------------------------------------------------------------------------

    def next_tests(self) -> list[GroupTest]:
        """Tests that may start now: pairwise disjoint and disjoint from those handed out and not
        recorded (a test is handed out once). Empty while the next step waits on a result."""
        busy = {x for t in self._outstanding for x in t.nodes}
        out: list[GroupTest] = []

        def issue(members: tuple[str, ...], search: _Search | None) -> bool:
            partner = None
            if len(members) == 1:
                partner = self._partner(members[0], busy)
                if partner is None:
                    return False  # every partner is in a test now: this one waits
            test = GroupTest(members, partner)
            busy.update(test.nodes)
            self._outstanding[test] = search
            out.append(test)
            return True

        for s in self._searches:
            if not s.testing:
                half = s.members if len(s.members) == 1 else self._pick(s.members, _half(len(s.members)))
                s.testing = issue(half, s)
        pool = sorted(self._undecided, key=self._rank.__getitem__)
        # Each search holds a faulty node, and each new group out now is sized to hold one.
        d_left = self._d_hint - len(self._faulty) - len(self._searches)
        d_left -= sum(s is None for s in self._outstanding.values())  # groups out from an earlier call
        if pool and d_left >= 1:
            groups: list[tuple[str, ...]]
            if len(pool) <= 2 * d_left - 2:  # Hwang: as dense as this, testing each alone is cheapest
                groups = [(x,) for x in pool]
            else:
                one = _group_for_one_left(len(pool)) if self._d_hint == 1 else None
                size = one or 2 ** math.floor(math.log2((len(pool) - d_left + 1) / d_left))
                groups = []
                for _ in range(d_left):  # the groups sequential Hwang would test next if all passed
                    if len(pool) < size:
                        break
                    groups.append(self._pick(pool, size))
                    taken = set(groups[-1])
                    pool = [x for x in pool if x not in taken]
            for g in groups:
                if not issue(g, None):
                    break
                self._undecided.difference_update(g)
        elif pool and not self._searches and not self._outstanding and issue(tuple(pool), None):
            # d_hint found: the rest in one test, once every search has returned its other halves.
            self._undecided.clear()
            self._remainder_tests += 1
        return out

    def record(self, test: GroupTest, passed: bool) -> None:
        """The outcome of a test ``next_tests`` handed out: passed or failed (the OR model)."""
        if test not in self._outstanding:
            raise ValueError(f"not a test handed out and unrecorded: {test}")
        if not isinstance(passed, bool):
            raise TypeError(f"passed must be a bool, got {type(passed).__name__}")
        search = self._outstanding.pop(test)
        self._tests_used += 1
        members = test.members
        if search is None:  # a new group (or one node) from the undecided
            if passed:
                self._cleared.update(members)
            elif len(members) == 1:
                self._failed_alone_once(members[0])
            else:
                self._searches.append(_Search(members))
            return
        search.testing = False
        if len(search.members) == 1:
            if self._failed_alone.get(members[0], 0):
                self._retests += 1
            else:
                self._confirmation_tests += 1
        rest = tuple(x for x in search.members if x not in members)
        if passed:
            self._cleared.update(members)
            search.members = rest
            if not rest:  # it passed alone: the failure that started this search was not its
                self._searches.remove(search)
        elif len(members) == 1:
            self._searches.remove(search)
            self._undecided.update(rest)
            self._failed_alone_once(members[0])
        else:
            search.members = members
            self._undecided.update(rest)

    # -- inside ----------------------------------------------------------------------------------

    def _failed_alone_once(self, node: str) -> None:
        self._failed_alone[node] = self._failed_alone.get(node, 0) + 1
        if self._failed_alone[node] > self._retest_failures:
            self._faulty.add(node)
        else:
            self._searches.append(_Search((node,)))  # tested alone again

    def _pick(self, candidates: Sequence[str], size: int) -> tuple[str, ...]:
        """``size`` of ``candidates`` (in leaf order) from one leaf if one holds enough (the
        smallest such), else from the fewest leaves (the fullest first); in leaf order."""
        by_leaf: dict[str, list[str]] = {}
        for x in candidates:
            by_leaf.setdefault(self._leaf_of.get(x, ""), []).append(x)
        fits = [leaf for leaf, xs in by_leaf.items() if len(xs) >= size]
        if fits:
            return tuple(by_leaf[min(fits, key=lambda leaf: len(by_leaf[leaf]))][:size])
        chosen: list[str] = []
        for xs in sorted(by_leaf.values(), key=len, reverse=True):
            chosen.extend(xs[: size - len(chosen)])
            if len(chosen) == size:
                break
        return tuple(sorted(chosen, key=self._rank.__getitem__))

    def _partner(self, node: str, busy: set[str]) -> str | None:
        """A known-healthy node not in a test now: of ``node``'s leaf first, a given one before one
        a test cleared."""
        leaf = self._leaf_of.get(node)
        free = [x for x in (*self._healthy, *sorted(self._cleared, key=self._rank.__getitem__)) if x not in busy]
        same = [x for x in free if self._leaf_of.get(x) == leaf]
        return (same or free)[0] if free else None


def _half(n: int) -> int:
    """The part of a failing group of n tested next: the largest power of two below n (n / 2 for
    2**a), so halves of groups of whole leaves are whole leaves."""
    return 2 ** (math.ceil(math.log2(n)) - 1)


def _group_for_one_left(n: int) -> int | None:
    """The group to test of n undecided nodes when one faulty node is left (None: use Hwang's)."""
    return _one_left(n)[1][n] if n <= ONE_LEFT_PROGRAM_NODES_MAX else None


def _one_left_tables(n_max: int) -> tuple[list[float], list[int]]:
    """Expected tests with one faulty node placed at random, built bottom up to n_max.

    e[m]: find and confirm it among m that a failed test says hold it, halving by ``_half``: a
    failure of one node alone needs no confirmation, an inferred one costs its test alone (e[1] =
    1). t[n]: among n undecided, the rest tested once more when it is found: test g; it fails, e[g]
    and the rest; it passes, t[n - g]. group[n] is the best g; of equals, the one most aligned to
    leaves (the most factors of two), then the larger.
    """
    e = [0.0, 1.0]
    for m in range(2, n_max + 1):
        s = _half(m)
        e.append(1.0 + s / m * (0.0 if s == 1 else e[s]) + (m - s) / m * e[m - s])
    t, group = [0.0], [0]
    for n in range(1, n_max + 1):
        cost = {g: 1.0 + g / n * (e[g] + (n > 1)) + (n - g) / n * t[n - g] for g in range(1, n + 1)}
        best = min(cost.values())
        group.append(max((g for g in cost if cost[g] <= best + 1e-9), key=lambda g: (g & -g, g)))
        t.append(best)
    return t, group


def _one_left(n: int) -> tuple[list[float], list[int]]:
    """The tables, built once to the next power of two at or above n (at least 256)."""
    return _one_left_cached(max(256, 2 ** math.ceil(math.log2(max(n, 1)))))


@cache
def _one_left_cached(n_max: int) -> tuple[list[float], list[int]]:
    return _one_left_tables(n_max)

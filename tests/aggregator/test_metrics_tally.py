"""The intake's tallies (aggregator/metrics.py TallyCounter, TallyHistogram) against prometheus_client's
Counter and Histogram fed the same values: the same exposition, line for line (``_created`` aside, a
timestamp of each one's construction)."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from vigil.aggregator.metrics import _INGEST_BUCKETS, TallyCounter, TallyHistogram


def _lines(registry: CollectorRegistry) -> tuple[list[str], int]:
    text = generate_latest(registry).decode().splitlines()
    return [line for line in text if "_created" not in line], sum("_created" in line for line in text)


def test_the_tallies_expose_what_prometheus_client_exposes() -> None:
    rng = random.Random(47)
    ours, theirs = CollectorRegistry(auto_describe=True), CollectorRegistry(auto_describe=True)
    counter, histogram = TallyCounter("t_reports", "Reports.", ours), TallyHistogram("t_seconds", "Seconds.",
                                                                                     _INGEST_BUCKETS, ours)
    ref_counter, ref_histogram = Counter("t_reports", "Reports.", registry=theirs), Histogram(
        "t_seconds", "Seconds.", buckets=_INGEST_BUCKETS, registry=theirs)
    assert _lines(ours) == _lines(theirs)  # before anything is counted
    for step in range(3_000):
        # Values on each bound exactly, between bounds, past the last one, zero, tiny and huge.
        amount = rng.choice([rng.choice(_INGEST_BUCKETS), rng.uniform(0, 0.2), rng.expovariate(1e4), 0.0, 5e-324,
                             1e9, rng.uniform(0, 1e-5)])
        histogram.observe(amount)
        ref_histogram.observe(amount)
        n = rng.choice([1, 1, 1, 2, 7])
        counter.inc(n)
        ref_counter.inc(n)
        if step % 500 == 0:
            assert _lines(ours) == _lines(theirs)
    assert _lines(ours) == _lines(theirs)
    assert _lines(ours)[1] > 0  # _created exposed as prometheus_client exposes it (compared by count above)

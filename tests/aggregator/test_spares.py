"""The spare pool: the sizing rule (binomial tail at the observed failure rate, with its prior),
the count and draws as read, when a verified node should join, and its metrics."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Sequence

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from vigil.aggregator.actuators.slurm import SlurmActuator, SlurmConfig
from vigil.aggregator.app import wire_spares
from vigil.aggregator.config import ConfigError, parse_config
from vigil.aggregator.engine import Engine
from vigil.aggregator.ledger import Ledger
from vigil.aggregator.metrics import AggregatorMetrics
from vigil.aggregator.spares import SparePool, SparesConfig, failure_rate, recommended_spares


def poisson_tail(mean: float, s: int) -> float:
    return 1 - sum(math.exp(-mean) * mean ** k / math.factorial(k) for k in range(s + 1))


def test_the_pool_is_the_smallest_size_whose_overflow_risk_is_within_the_target() -> None:
    # 1,000 nodes at Llama 3's 1.6e-4 removals per node-hour, a day to refill: 3.8 failures expected.
    s = recommended_spares(1000, 1.6e-4, 86400, 0.01)
    assert s == 9
    mean = 1000 * -math.expm1(-1.6e-4 * 24)
    assert poisson_tail(mean, s) <= 0.012 and poisson_tail(mean, s - 1) > 0.01  # Poisson agrees
    assert recommended_spares(1000, 1.6e-4, 86400, 0.001) > s  # a smaller risk needs more
    assert recommended_spares(1000, 3.2e-4, 86400, 0.01) > s  # so does a worse fleet
    assert recommended_spares(0, 1e-3, 86400, 0.01) == recommended_spares(100, 0.0, 86400, 0.01) == 0
    assert recommended_spares(20_000, 1.6e-4, 86400, 0.01) > 0  # no underflow on a large fleet


def test_the_observed_rate_moves_from_the_prior_as_history_accumulates() -> None:
    cfg = SparesConfig()
    assert failure_rate(0, 0, cfg) == cfg.prior_rate_per_node_hour
    assert failure_rate(50, 100_000, cfg) > 4e-4  # 5e-4 observed, weighed against the prior
    assert failure_rate(0, 1_000_000, cfg) < 2e-6


def test_draws_are_spares_gone_between_reads_and_a_short_pool_wants_a_verified_node() -> None:
    pool = SparePool(SparesConfig(enabled=True))
    assert pool.available is None and not pool.wants_spare()  # never read: unknown, not short
    pool.size(1000, 0, 0)
    pool.observe(["n1", "n2"])
    pool.observe(["n2", "n3"])
    assert (pool.available, pool.draws) == (2, 1)
    assert pool.wants_spare()  # 2 of 9
    assert not SparePool(SparesConfig(refill=False)).wants_spare()
    pool.failed("timeout")
    registry = CollectorRegistry()
    registry.register(pool.collector())
    text = generate_latest(registry).decode()
    for line in ("vigil_aggregator_spares_available 2.0", "vigil_aggregator_spares_recommended 9.0",
                 "vigil_aggregator_spare_draws_total 1.0",
                 'vigil_aggregator_spares_read_errors_total{reason="timeout"} 1.0'):
        assert line in text


def test_the_config_sections_default_off_and_refuse_a_hostile_feature() -> None:
    config = parse_config({})
    assert not config.spares.enabled and not config.job_recovery.enabled
    assert parse_config({"spares": {"enabled": True, "slurm_feature": "spare_a"}}).spares.slurm_feature == "spare_a"
    for bad in ("a,b", "x y", ""):  # a list or a word scontrol would split
        with pytest.raises(ConfigError, match="slurm_feature"):
            parse_config({"spares": {"slurm_feature": bad}})


def test_the_app_reads_the_pool_through_the_slurm_actuator_and_feeds_the_planner() -> None:
    def sinfo(argv: Sequence[str], timeout_seconds: float) -> str:
        return json.dumps({"nodes": [{"name": "vnode3", "state": "idle", "features": "vigil_spare",
                                      "active_features": "vigil_spare"}]})

    config = parse_config({"spares": {"enabled": True}, "job_recovery": {"enabled": True}})
    engine = Engine(config, Ledger.in_memory(), detectors=[])
    metrics = AggregatorMetrics(dict)
    slurm = SlurmActuator(SlurmConfig(), run=sinfo)

    async def main() -> None:
        task = asyncio.create_task(wire_spares(config, engine, engine.ledger, metrics, {"slurm": slurm}, lambda: 0.0)())
        async with asyncio.timeout(10):
            while engine.spares_available() is None:
                await asyncio.sleep(0.01)
        task.cancel()

    asyncio.run(main())
    assert engine.spares_available() == 1
    # No node reports yet: nothing to cover, so a verified node is not wanted as a spare.
    assert slurm.spare_feature == "vigil_spare" and not slurm.spare_wanted()
    assert b"vigil_aggregator_spares_available 1.0" in metrics.render()

"""The training collector's short heartbeat path (``ingest``'s update of a known rank) against
the long way (decode, key, record, ``_observe`` for every heartbeat) over random evolving streams:
the same answers, the same rank state, the same refusal counts and the same collected summaries."""

from __future__ import annotations

import json
import random

import pytest

from tests.agent.collectors.test_training import T0, FakeProcesses
from vigil.agent.attribution import UNVERIFIED, Sender
from vigil.agent.collectors.training import (
    TrainingCollector,
    TrainingConfig,
    _Record,
    decode_heartbeat,
    job_key_of,
)


def long_way(c: TrainingCollector, payload: bytes, now: float, sender: Sender) -> str | None:
    """``ingest`` as it was before its short path: every accepted heartbeat through ``_observe``."""
    reason: str | None
    if len(payload) > c.config.max_payload_bytes:
        reason = "too_large"
    else:
        hb = decode_heartbeat(payload)
        if isinstance(hb, str):
            reason = hb
        else:
            keyed = job_key_of(hb.job, sender)
            if isinstance(keyed, str):
                reason = keyed
            else:
                key, name = keyed
                pid = sender.pid if sender.pid is not None else hb.pid
                record = _Record(now, hb.step, hb.step_seconds, hb.compute_seconds, hb.comm_seconds,
                                 hb.data_seconds, None if hb.phase in (None, "training") else hb.phase,
                                 hb.loss, hb.grad_norm)
                with c._lock:
                    reason = c._observe(key, hb.rank, hb.gpu, pid, record, heartbeat=True, trust=sender.trust,
                                        owner=sender.pid, name=name)
    if reason is not None:
        c._rejected[reason] += 1
    return reason


def stream(rng: random.Random, n: int) -> list[tuple[float, bytes, Sender]]:
    """Heartbeats of a few ranks and jobs: steps that advance, repeat and restart lower, new pids,
    checkpoints and evaluations, losses (finite or not), senders that change, and garbage."""
    steps = {r: 0 for r in range(4)}
    senders = [UNVERIFIED, Sender("scheduler", job="4242", pid=100, uid=7),
               Sender("scheduler", job="4242", pid=101, uid=7), Sender("uid", pid=102, uid=8)]
    out = []
    now = T0
    for _ in range(n):
        now += rng.choice((0.0, 0.05, 0.5, 1.0, 3.0))
        rank = rng.randrange(4)
        roll = rng.random()
        if roll < 0.8:
            steps[rank] += 1
        elif roll < 0.9:
            steps[rank] = max(0, steps[rank] - rng.randrange(1, 5))  # a restart from a checkpoint
        body: dict[str, object] = {"job": rng.choice(("j1", "j1", "j1", "j2", "4242", "bad name")), "rank": rank,
                                   "step": steps[rank], "step_seconds": rng.choice((0.5, 1.0, 1.5))}
        if rng.random() < 0.5:
            body["gpu"] = rng.choice((rank, rank + 1))
        if rng.random() < 0.3:
            body["pid"] = rng.choice((500 + rank, 600 + rank))
        if rng.random() < 0.15:
            body["phase"] = rng.choice(("checkpointing", "evaluating", "training"))
        if rng.random() < 0.1:
            body["loss"] = rng.choice((2.0, 1.5, "nan"))
        if rng.random() < 0.05:
            body["grad_norm"] = rng.choice((0.5, "inf"))
        payload = json.dumps(body).encode()
        if rng.random() < 0.03:
            payload = rng.choice((b"not json", b"[]", payload[:-1], b'{"job":"j1","rank":0,"step":1}'))
        sender = senders[0] if rng.random() < 0.7 else rng.choice(senders)
        out.append((now, payload, sender))
    return out


@pytest.mark.parametrize("seed", range(12))
def test_short_path_matches_the_long_way(seed: int) -> None:
    rng = random.Random(seed)
    config = TrainingConfig(accept_unverified=True, max_steps_per_rank=16, max_ranks_per_job=3)
    alive = FakeProcesses(100)
    fast = TrainingCollector(config, pid_alive=alive)
    slow = TrainingCollector(config, pid_alive=alive)
    for i, (now, payload, sender) in enumerate(stream(rng, 600)):
        if i == 300:
            alive.alive.clear()  # rank owners exit: later senders take their ranks over
        assert fast.ingest(payload, now, sender) == long_way(slow, payload, now, sender), i
        assert fast._ranks == slow._ranks, i
        if i % 97 == 0:
            assert fast.collect(now) == slow.collect(now), i
    assert fast._names == slow._names
    assert fast._rejected == slow._rejected

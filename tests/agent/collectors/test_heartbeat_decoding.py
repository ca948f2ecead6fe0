"""The heartbeat decoder's one-pass msgspec decode refuses what the step-by-step reference refuses,
for the same reason, and accepts what it accepts with the same values."""

import json
import random

import pytest

from vigil.agent.attribution import IN_PROCESS
from vigil.agent.collectors.training import (
    TrainingCollector,
    TrainingConfig,
    decode_heartbeat,
    decode_heartbeat_by_steps,
)

GOOD = {"job": "j", "rank": 0, "step": 1, "step_seconds": 1.0, "compute_seconds": 0.8, "comm_seconds": 0.1,
        "data_seconds": 0.1, "gpu": 0, "pid": 42, "ts": 1.7e9, "phase": "training", "timing": "cuda_events",
        "loss": 2.5, "grad_norm": "nan"}


@pytest.mark.parametrize(("payload", "reason"), [
    (b"\xef\xbb\xbf" + json.dumps(GOOD).encode(), None),  # a UTF-8 byte-order mark: json takes it
    (json.dumps(GOOD).encode("utf-16"), None),  # so does UTF-16: msgspec refuses, the reference decides
    (b'{"job":"a\\ud800b","rank":0,"step":1,"step_seconds":1}', "bad_text"),  # escaped lone surrogate
    (b'{"job":"a\xed\xa0\x80b","rank":0,"step":1,"step_seconds":1}', "bad_text"),  # a surrogate's UTF-8 bytes
    (b'{"job":"a\xffb","rank":0,"step":1,"step_seconds":1}', "invalid_json"),  # not UTF-8 at all
    (b'{"job":"a\nb","rank":0,"step":1,"step_seconds":1}', "invalid_json"),  # a raw control character
    (b'{"job":"j\x7f","rank":0,"step":1,"step_seconds":1}', "bad_text"),  # DEL: valid JSON, not printable
    (b'{"job":"j","job":"k","rank":0,"step":1,"step_seconds":1}', None),  # a repeated key: the last wins
    (b'{"rank":-1,"stepz":1}', "unknown_field"),  # the unknown field is named before the schema
    (b'{"rank":-1,"job":"j","step":1,"step_seconds":1} x', "invalid_json"),  # and bad JSON before both
    (b'{"job":"j","rank":0,"step":1,"step_seconds":1e999}', "schema"),
    (b'{"job":"j","rank":0,"step":1,"step_seconds":1,"loss":Infinity}', "invalid_json"),
    (b'{"job":"j","rank":1.0,"step":1,"step_seconds":1}', "schema"),  # a float for an int
    (b'{"job":"j","rank":0,"step":1,"step_seconds":"1"}', "schema"),
    (b'[{"job":"j","rank":0,"step":1,"step_seconds":1}]', "not_object"),
    (b"null", "not_object"),
    (b"[" * 100_000, "invalid_json"),  # deeper than either parser goes
])
def test_each_refusal_keeps_the_reference_reason(payload: bytes, reason: str | None) -> None:
    expected = decode_heartbeat_by_steps(payload)
    assert (expected if isinstance(expected, str) else None) == reason
    assert decode_heartbeat(payload) == expected
    collector = TrainingCollector(TrainingConfig(max_payload_bytes=1 << 20), pid_alive=lambda _: True)
    assert collector.ingest(payload, 100.0, IN_PROCESS) == reason


def _mutations(rng: random.Random) -> bytes:
    """A heartbeat with a field dropped, retyped, out of bounds, unknown or garbled, or its bytes cut or flipped."""
    data = dict(GOOD)
    for _ in range(rng.randint(0, 3)):
        key = rng.choice([*GOOD, "extra"])
        data[key] = rng.choice([None, -1, 0, 1, 2**64, 1.5, -0.0, 1e18, 1e19, "", "x", "nan", "inf", "training",
                                "checkpointing", "cpu", "\x1b[31m", "é", [1], {"a": 1}, True])
        if rng.random() < 0.2:
            data.pop(rng.choice(list(data)), None)
    raw = bytearray(json.dumps(data, ensure_ascii=rng.random() < 0.5).encode())
    if rng.random() < 0.3 and raw:
        i = rng.randrange(len(raw))
        raw[i] = rng.randrange(256)
    if rng.random() < 0.1:
        raw = raw[:rng.randrange(len(raw) + 1)]
    return bytes(raw)


def test_randomized_payloads_decode_as_the_reference_does() -> None:
    rng = random.Random(47)
    reasons: set[str | None] = set()
    for _ in range(5000):
        payload = _mutations(rng)
        expected = decode_heartbeat_by_steps(payload)
        assert decode_heartbeat(payload) == expected, payload
        reasons.add(expected if isinstance(expected, str) else None)
    assert reasons >= {None, "invalid_json", "unknown_field", "schema", "bad_text"}  # the walk reached each

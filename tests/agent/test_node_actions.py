"""contract/node_actions.py: the one table of node actions, and the signature that binds a request to
one node's key."""

from __future__ import annotations

import typing

import pytest

from vigil.contract.node_actions import NODE_ACTIONS, node_key, sign, signature_ok
from vigil.contract.wire import NodeActionName, NodeActionRequest, SchemaError, convert, replace

MASTER = b"m" * 32


def _request(**changes: object) -> NodeActionRequest:
    base: dict[str, object] = {"id": "d1", "action": "reset_gpu", "node": "gpu-1", "boot_id": "b1", "gpu": 3,
                               "gpu_uuid": "GPU-3", "issued_at": 1000.0, "expires_at": 1600.0}
    return convert({**base, **changes}, NodeActionRequest)


def test_the_wire_literal_lists_exactly_the_table() -> None:
    assert set(typing.get_args(NodeActionName)) == set(NODE_ACTIONS)


def test_an_unknown_action_is_not_a_request() -> None:
    with pytest.raises(SchemaError):
        _request(action="run_shell")


def test_a_signed_request_verifies_only_under_its_own_node_key() -> None:
    signed = sign(_request(), node_key(MASTER, "gpu-1"))
    assert len(signed.signature) == 64
    assert signature_ok(signed, node_key(MASTER, "gpu-1"))
    assert not signature_ok(signed, node_key(MASTER, "gpu-2"))
    assert not signature_ok(signed, node_key(b"x" * 32, "gpu-1"))


@pytest.mark.parametrize("change", [{"node": "gpu-2"}, {"gpu": 4}, {"boot_id": "b2"}, {"expires_at": 9e9},
                                    {"action": "request_reboot"}, {"id": "d2"}])
def test_any_changed_field_breaks_the_signature(change: dict[str, object]) -> None:
    key = node_key(MASTER, "gpu-1")
    signed = sign(_request(), key)
    tampered = replace(signed, **change)
    assert not signature_ok(tampered, key)


def test_an_unsigned_request_does_not_verify() -> None:
    assert not signature_ok(_request(), node_key(MASTER, "gpu-1"))

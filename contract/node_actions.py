"""Node actions: the closed list of things the aggregator may ask an agent to do on its node, and
the signed, node-bound request and the reported result that carry them (wire types both services
share; neither service's internals live here).

A request travels in the aggregator's answer to a report (``POST /v1/reports`` -> 202
``{"requests": [...]}``); the agent checks it (known action, allowed by its config, addressed to
its node and current boot, not expired, HMAC-SHA256 signature under its node key) and reports a
``NodeActionResult`` in a following report. Nothing outside ``NODE_ACTIONS`` is ever accepted.
This module signs and checks; it runs nothing.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass

import msgspec

from vigil.contract.wire import NodeActionRequest, NodeActionResult, replace


@dataclass(frozen=True)
class NodeActionSpec:
    """What one node action does and what it needs."""

    description: str
    needs_gpu: bool  # the request names one GPU (index and uuid), checked against the node's inventory


# The one table of what an agent can be asked to do (wire.NodeActionName lists the same keys; a
# test keeps them equal). Each is off on the agent until its config
# lists it under ``node_actions.allow``.
NODE_ACTIONS: dict[str, NodeActionSpec] = {
    "reset_gpu": NodeActionSpec(
        description="reset one GPU (nvidia-smi --gpu-reset), only when no compute process holds it",
        needs_gpu=True,
    ),
    "request_reboot": NodeActionSpec(
        description="ask the site's reboot daemon to reboot the node (write its sentinel file, e.g. "
                    "kured's /var/run/reboot-required); the daemon drains and reboots under its own lock",
        needs_gpu=False,
    ),
    "run_probes": NodeActionSpec(
        description="run the named probes (agent/probes/: a timed burn, memory, P2P, dcgmi diag, ib_write_bw, "
                    "a collective) and report each measurement, signed; an intrusive probe is refused while a "
                    "compute process holds a GPU",
        needs_gpu=False,
    ),
}
# The signing key's derivation label: node key = HMAC-SHA256(master key, label + node name), so a
# node holds only its own key and cannot sign a request for any other node.
_KEY_LABEL = b"vigil node action v1:"


def node_key(master_key: bytes, node: str) -> bytes:
    """The key one node verifies with (and the aggregator signs with for that node)."""
    return hmac.new(master_key, _KEY_LABEL + node.encode(), hashlib.sha256).digest()


def _signed_bytes(message: NodeActionRequest | NodeActionResult) -> bytes:
    # Every field but the signature, absent ones as null, nested structs as their builtins: the
    # same bytes on both sides.
    body = {name: getattr(message, name) for name in message.__struct_fields__ if name != "signature"}
    return json.dumps(msgspec.to_builtins(body), sort_keys=True, separators=(",", ":")).encode()


def sign(request: NodeActionRequest, key: bytes) -> NodeActionRequest:
    """``request`` with its signature under ``key`` (a node key)."""
    signature = hmac.new(key, _signed_bytes(request), hashlib.sha256).hexdigest()
    return replace(request, signature=signature)


def signature_ok(request: NodeActionRequest, key: bytes) -> bool:
    expected = hmac.new(key, _signed_bytes(request), hashlib.sha256).hexdigest()
    return hmac.compare_digest(expected, request.signature)


def sign_result(result: NodeActionResult, key: bytes) -> NodeActionResult:
    """``result`` with its signature under ``key`` (the node key): the agent signs what it measured,
    bound to the request's id and to its node and boot (which the result names)."""
    signature = hmac.new(key, b"result:" + _signed_bytes(result), hashlib.sha256).hexdigest()
    return replace(result, signature=signature)


def result_signature_ok(result: NodeActionResult, key: bytes) -> bool:
    expected = hmac.new(key, b"result:" + _signed_bytes(result), hashlib.sha256).hexdigest()
    return hmac.compare_digest(expected, result.signature)

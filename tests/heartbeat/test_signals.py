"""The client's application signals: a step's loss and gradient norm reach the agent as the wire
spells them (a number, or "nan"/"inf"/"-inf"), a tensor is read with exactly one ``.item()``, and no
value, however odd, costs the heartbeat or raises into the loop."""

from __future__ import annotations

import json
import math
import socket
from collections.abc import Iterator
from typing import Any

import pytest

from tests.heartbeat.fakes import RecordingHeartbeat
from vigil.contract.wire import Heartbeat as WireHeartbeat
from vigil.contract.wire import convert
from vigil_heartbeat.client import VALUE_BOUND, Heartbeat
from vigil_heartbeat.pytorch import StepTimer


@pytest.fixture
def receiver() -> Iterator[socket.socket]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(2.0)
    yield sock
    sock.close()


def _beat(receiver: socket.socket, **signals: Any) -> dict[str, Any]:
    hb = Heartbeat(job="j", rank=0, addr=receiver.getsockname(), env={})
    hb.step(10, 0.5, **signals)
    data = json.loads(receiver.recv(4096))
    convert(data, WireHeartbeat)  # the agent's own decoder accepts it
    assert hb.sent == 1 and hb.dropped == 0
    return data


class FakeTensor:
    """A 0-d tensor: ``.item()`` is the only read (on CUDA, the one synchronising call)."""

    def __init__(self, value: float) -> None:
        self.value = value
        self.items = 0

    def item(self) -> float:
        self.items += 1
        return self.value


def test_finite_values_are_numbers(receiver):
    data = _beat(receiver, loss=2.3456789, grad_norm=0.75)
    assert data["loss"] == pytest.approx(2.3456789) and data["grad_norm"] == pytest.approx(0.75)
    assert _beat(receiver, loss=-1.5)["loss"] == -1.5  # a loss may be negative (e.g. an ELBO)
    assert _beat(receiver, loss=3)["loss"] == 3  # an int is a number too


@pytest.mark.parametrize(("value", "spelled"), [(math.nan, "nan"), (math.inf, "inf"), (-math.inf, "-inf")])
def test_non_finite_values_are_the_wire_strings(receiver, value, spelled):
    data = _beat(receiver, loss=value, grad_norm=value)
    assert data["loss"] == spelled and data["grad_norm"] == spelled


def test_nan_only_in_the_gradient_norm(receiver):
    data = _beat(receiver, loss=2.0, grad_norm=math.nan)
    assert data["loss"] == 2.0 and data["grad_norm"] == "nan"


def test_a_finite_value_beyond_the_agents_bound_is_sent_as_the_bound(receiver):
    data = _beat(receiver, loss=1e30, grad_norm=1e300)
    assert data["loss"] == VALUE_BOUND and data["grad_norm"] == VALUE_BOUND
    assert _beat(receiver, loss=-1e30)["loss"] == -VALUE_BOUND


def test_a_tensor_is_read_with_one_item_call(receiver):
    loss, norm = FakeTensor(1.25), FakeTensor(math.inf)
    data = _beat(receiver, loss=loss, grad_norm=norm)
    assert data["loss"] == 1.25 and data["grad_norm"] == "inf"
    assert loss.items == 1 and norm.items == 1


def test_a_real_torch_tensor(receiver):
    torch = pytest.importorskip("torch")
    data = _beat(receiver, loss=torch.tensor(float("nan")), grad_norm=torch.tensor(3.5, dtype=torch.float64))
    assert data["loss"] == "nan" and data["grad_norm"] == 3.5


class Broken:
    def item(self) -> float:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


@pytest.mark.parametrize("value", ["low", Broken(), [1.0, 2.0], object()])
def test_an_unreadable_value_costs_its_field_never_the_heartbeat(receiver, value):
    hb = Heartbeat(job="j", rank=0, addr=receiver.getsockname(), env={})
    hb.step(10, 0.5, loss=value, grad_norm=value)
    data = json.loads(receiver.recv(4096))
    assert data["step"] == 10 and "loss" not in data and "grad_norm" not in data
    assert hb.sent == 1 and hb.dropped == 0 and hb.unreadable == 2


def test_a_negative_gradient_norm_is_left_out_not_sent(receiver):
    # The agent refuses a negative norm, and with it the whole heartbeat: leave the field out.
    hb = Heartbeat(job="j", rank=0, addr=receiver.getsockname(), env={})
    hb.step(10, 0.5, loss=1.0, grad_norm=-0.5)
    data = json.loads(receiver.recv(4096))
    assert data["loss"] == 1.0 and "grad_norm" not in data
    assert hb.unreadable == 1


def test_no_signal_no_field(receiver):
    data = _beat(receiver)
    assert "loss" not in data and "grad_norm" not in data


def test_step_timer_passes_the_signals_through():
    hb = RecordingHeartbeat()
    timer = StepTimer(hb, use_cuda=False)
    timer.step(1, loss=0.5, grad_norm=math.nan)
    timer.step(2)
    assert hb.beats[0]["loss"] == 0.5 and math.isnan(hb.beats[0]["grad_norm"])
    assert "loss" not in hb.beats[1] and "grad_norm" not in hb.beats[1]

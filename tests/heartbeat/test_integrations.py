"""The Hugging Face Trainer callback and the DeepSpeed engine wrapper, against fakes that call them
as the real libraries do; the client's phases on the wire; the client installable alone."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from vigil.contract.wire import Heartbeat as WireHeartbeat
from vigil.contract.wire import convert
from vigil_heartbeat import Heartbeat
from vigil_heartbeat.integrations import hf_callback, watch_deepspeed

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def receiver():
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(2.0)
    yield sock
    sock.close()


def received(sock: socket.socket) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    sock.settimeout(0.2)
    while True:
        try:
            data = sock.recv(4096)
        except TimeoutError:
            return out
        msg = json.loads(data)
        convert(msg, WireHeartbeat)  # every datagram is a valid wire heartbeat
        out.append(msg)


class TrainerCallback:
    """transformers.TrainerCallback's shape: every event a no-op."""

    def on_step_begin(self, args, state, control, **kwargs): ...
    def on_step_end(self, args, state, control, **kwargs): ...
    def on_evaluate(self, args, state, control, **kwargs): ...
    def on_save(self, args, state, control, **kwargs): ...
    def on_train_end(self, args, state, control, **kwargs): ...


class Control:
    def __init__(self) -> None:
        self.should_evaluate = False
        self.should_save = False


class State:
    global_step = 0


class FakeTrainer:
    """Trainer._inner_training_loop's order: on_step_begin; optimizer step; global_step += 1;
    on_step_end (the flow callback first sets should_evaluate/should_save); then
    _maybe_log_save_evaluate: evaluate -> on_evaluate, save -> on_save."""

    def __init__(self, callback: Any, eval_steps: int, save_steps: int) -> None:
        self.cb = callback
        self.eval_steps = eval_steps
        self.save_steps = save_steps
        self.log: list[str] = []

    def train(self, steps: int) -> None:
        state, args = State(), object()
        for _ in range(steps):
            control = Control()
            self.cb.on_step_begin(args, state, control)
            state.global_step += 1
            control.should_evaluate = state.global_step % self.eval_steps == 0
            control.should_save = state.global_step % self.save_steps == 0
            self.cb.on_step_end(args, state, control)
            if control.should_evaluate:
                self.log.append(f"evaluate@{state.global_step}:{self.cb.heartbeat.current_phase}")
                self.cb.on_evaluate(args, state, control)
            if control.should_save:
                self.log.append(f"save@{state.global_step}:{self.cb.heartbeat.current_phase}")
                self.cb.on_save(args, state, control)
        self.cb.on_train_end(args, state, Control())


def test_hf_callback_beats_every_step_and_announces_evaluation_and_saving(receiver):
    hb = Heartbeat(job="hf", rank=1, addr=receiver.getsockname(), env={})
    trainer = FakeTrainer(hf_callback(hb, base=TrainerCallback), eval_steps=4, save_steps=6)
    trainer.train(12)
    # The Trainer evaluates and saves with the agent told so beforehand.
    assert trainer.log == ["evaluate@4:evaluating", "save@6:checkpointing", "evaluate@8:evaluating",
                           "evaluate@12:evaluating", "save@12:checkpointing"]
    msgs = received(receiver)
    steps = [m["step"] for m in msgs if m["step_seconds"] > 0 or "phase" not in m]
    assert sorted(set(steps)) == list(range(1, 13))
    phases = [(m["step"], m.get("phase", "training")) for m in msgs if m["step_seconds"] == 0]
    assert (4, "evaluating") in phases and (6, "checkpointing") in phases and (12, "checkpointing") in phases
    assert hb.current_phase == "training"


def test_hf_callback_imports_transformers_only_when_built():
    code = ("import sys; import vigil_heartbeat.integrations, vigil_heartbeat.pytorch; "
            "print([m for m in ('transformers', 'deepspeed', 'torch') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


class FakeEngine:
    """deepspeed.DeepSpeedEngine's shape: step() advances global_steps at gradient-accumulation
    boundaries; save_checkpoint(save_dir, tag) writes for a while."""

    def __init__(self, hb: Heartbeat, accumulation: int) -> None:
        self.global_steps = 0
        self.micro_steps = 0
        self.accumulation = accumulation
        self.hb = hb
        self.saw_phase: list[str] = []

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.accumulation == 0

    def step(self) -> None:
        if self.is_gradient_accumulation_boundary():
            self.global_steps += 1
        self.micro_steps += 1

    def save_checkpoint(self, save_dir: str, tag: str | None = None) -> bool:
        self.saw_phase.append(self.hb.current_phase)
        return True


def test_deepspeed_wrapper_beats_per_optimizer_step_and_marks_checkpoints(receiver):
    hb = Heartbeat(job="ds", rank=0, addr=receiver.getsockname(), env={})
    engine = FakeEngine(hb, accumulation=4)
    assert watch_deepspeed(engine, hb) is hb
    for _ in range(12):
        engine.step()
    assert engine.save_checkpoint("/ckpt", tag="global_step3") is True
    assert engine.saw_phase == ["checkpointing"] and hb.current_phase == "training"
    msgs = received(receiver)
    assert [m["step"] for m in msgs if m["step_seconds"] > 0] == [1, 2, 3]
    assert [m.get("phase") for m in msgs if m["step_seconds"] == 0] == ["checkpointing", None]


def test_phase_and_timing_fields_on_the_wire(receiver):
    hb = Heartbeat(job="j", rank=2, gpu=2, addr=receiver.getsockname(), env={})
    hb.step(10, 1.0, compute_seconds=0.8, comm_seconds=0.1, timing="cuda_events")
    with hb.checkpointing():
        hb.set_phase("bogus")  # unknown: ignored, never raises
    with hb.evaluating():
        hb.step(11, 1.0)
    hb.step(12, 1.0, timing="nonsense")
    msgs = received(receiver)
    assert msgs[0]["timing"] == "cuda_events" and "phase" not in msgs[0]
    assert [(m["step"], m.get("phase")) for m in msgs[1:]] == [
        (10, "checkpointing"), (10, None), (10, "evaluating"), (11, "evaluating"), (11, None), (12, None)]
    assert "timing" not in msgs[-1]


def test_client_installs_alone_with_the_standard_library_only(tmp_path: Path):
    # -S: no site-packages at all, so any third-party import would fail; only clients/heartbeat on
    # the path, so nothing of vigil's daemon (agent, aggregator) is importable either.
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import vigil_heartbeat, vigil_heartbeat.pytorch, "
            "vigil_heartbeat.integrations; hb = vigil_heartbeat.Heartbeat(job='x', env={}); hb.step(1); "
            "print(hb.sent + hb.dropped, 'agent' in sys.modules)")
    out = subprocess.run([sys.executable, "-S", "-c", code, str(REPO / "clients" / "heartbeat")], cwd=tmp_path,
                         capture_output=True, text=True, timeout=30, check=True,
                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert out.stdout.split() == ["1", "False"]

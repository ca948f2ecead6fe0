"""Fakes of the APIs the heartbeat helpers drive, behaving like the real ones where it matters.

``FakeGpu`` is one GPU's stream: work queued by the host finishes later, when the test advances
the GPU's clock. ``FakeCudaEvent`` is ``torch.cuda.Event(enable_timing=True)``: ``record()`` marks
the point after the work queued so far, ``query()`` says whether the GPU has passed it, and
``elapsed_time()`` raises, as CUDA does, unless both events have completed. ``RecordingHeartbeat``
keeps what a StepTimer sends.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from vigil_heartbeat.client import Heartbeat


class FakeGpu:
    def __init__(self) -> None:
        self.now = 0.0  # how far the GPU has executed
        self.queued_until = 0.0  # when the work queued so far will be done
        self.syncs = 0

    def enqueue(self, seconds: float) -> None:
        self.queued_until = max(self.queued_until, self.now) + seconds

    def wait_until(self, t: float) -> None:
        """A stream wait (a collective that cannot finish before its peers): queued work resumes at t."""
        self.queued_until = max(self.queued_until, t)

    def run_to(self, t: float) -> None:
        self.now = t

    def synchronize(self) -> None:  # what the helper must never call
        self.syncs += 1
        self.now = max(self.now, self.queued_until)


class FakeCudaEvent:
    def __init__(self, gpu: FakeGpu, enable_timing: bool = False) -> None:
        self.gpu = gpu
        self.enable_timing = enable_timing
        self.at: float | None = None

    def record(self, stream: Any = None) -> None:
        self.at = self.gpu.queued_until

    def query(self) -> bool:
        return self.at is not None and self.gpu.now >= self.at

    def synchronize(self) -> None:
        self.gpu.synchronize()

    def elapsed_time(self, end: FakeCudaEvent) -> float:
        if not self.enable_timing or not end.enable_timing:
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if not (self.query() and end.query()):
            raise RuntimeError("CUDA error: device not ready")
        assert self.at is not None and end.at is not None
        return (end.at - self.at) * 1000.0


def fake_torch(gpu: FakeGpu | None, *, available: bool = True) -> Any:
    cuda = SimpleNamespace(
        is_available=lambda: available,
        Event=lambda enable_timing=False: FakeCudaEvent(gpu, enable_timing) if gpu is not None else None,
        synchronize=lambda: gpu.synchronize() if gpu is not None else None,
    )
    return SimpleNamespace(cuda=cuda)


class RecordingHeartbeat(Heartbeat):
    """A Heartbeat (what StepTimer takes) whose ``step`` records instead of sending; its socket is
    closed at once, so nothing can leave it."""

    def __init__(self) -> None:
        super().__init__(job="test", rank=0, env={})
        self.close()
        self.beats: list[dict[str, Any]] = []

    def step(self, step: int, step_seconds: float | None = None, compute_seconds: float | None = None,
             comm_seconds: float | None = None, data_seconds: float | None = None, *,
             timing: str | None = None, loss: object = None, grad_norm: object = None) -> None:
        beat = {"step": step, "compute": compute_seconds, "comm": comm_seconds, "data": data_seconds, "timing": timing}
        beat.update({k: v for k, v in (("loss", loss), ("grad_norm", grad_norm)) if v is not None})
        self.beats.append(beat)


class ManualClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

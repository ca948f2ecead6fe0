"""Heartbeats from the Hugging Face Trainer and from a DeepSpeed engine, without code in the loop.

``hf_callback(hb)`` returns a ``transformers.TrainerCallback`` that sends one heartbeat per
optimizer step and tells the agent when the Trainer evaluates or saves a checkpoint;
``watch_deepspeed(engine, hb)`` wraps a DeepSpeed engine's ``step`` and ``save_checkpoint`` the
same way. Neither imports its library at module import time. Both send step counts and step
times only: they cannot say which rank is slow in synchronous training (every rank's step is
equally long) unless the loop also uses ``vigil_heartbeat.pytorch.StepTimer``.
"""

from __future__ import annotations

import functools
from typing import Any

from vigil_heartbeat.client import Heartbeat


def hf_callback(hb: Heartbeat | None = None, *, base: type | None = None) -> Any:
    """A ``TrainerCallback`` instance: ``Trainer(..., callbacks=[hf_callback()])``.

    ``base`` is the callback base class (default ``transformers.TrainerCallback``). The Trainer
    decides to evaluate or save in ``on_step_end`` (its flow callback sets ``control.should_evaluate``
    and ``control.should_save`` before ours runs), then evaluates (``on_evaluate``) and saves
    (``on_save``); the phases follow that order.
    """
    if base is None:
        from transformers import TrainerCallback  # only when the Trainer is used

        base = TrainerCallback
    beat = hb if hb is not None else Heartbeat()

    class VigilHeartbeatCallback(base):  # type: ignore[misc, valid-type]
        heartbeat = beat

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            beat.step(int(state.global_step))
            if getattr(control, "should_evaluate", False):
                beat.set_phase("evaluating")
            elif getattr(control, "should_save", False):
                beat.set_phase("checkpointing")

        def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            beat.set_phase("checkpointing" if getattr(control, "should_save", False) else "training")

        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            beat.set_phase("training")

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            beat.set_phase("training")

    return VigilHeartbeatCallback()


def watch_deepspeed(engine: Any, hb: Heartbeat | None = None) -> Heartbeat:
    """Wrap ``engine.step`` (one heartbeat per optimizer step, at gradient-accumulation
    boundaries, numbered by ``engine.global_steps``) and ``engine.save_checkpoint`` (phase
    "checkpointing" while it runs) on this engine instance. Returns the heartbeat client."""
    beat = hb if hb is not None else Heartbeat()
    step = engine.step
    save = engine.save_checkpoint

    @functools.wraps(step)
    def timed_step(*args: Any, **kwargs: Any) -> Any:
        boundary = bool(engine.is_gradient_accumulation_boundary())
        out = step(*args, **kwargs)
        if boundary:
            beat.step(int(engine.global_steps))
        return out

    @functools.wraps(save)
    def saving(*args: Any, **kwargs: Any) -> Any:
        with beat.checkpointing():
            return save(*args, **kwargs)

    engine.step = timed_step
    engine.save_checkpoint = saving
    return beat

"""Per-rank compute time and collective wait for PyTorch, measured so the slow GPU ranks first.

``StepTimer`` times a rank's compute and its wait in collectives and sends them with each step's
heartbeat. On a GPU it records CUDA events on the current stream and reads a step's events only
once ``event.query()`` says the GPU has passed them (usually one step later), so it never stalls
the GPU with a synchronize; without CUDA it times the host (``time.perf_counter``) and marks the
heartbeat ``timing: cpu``. It imports torch only when a timer is built, and never raises into
the training loop.

What is measured, and why the slow rank comes first:

* ``with timer.compute():`` around forward and backward; ``with timer.comm():`` around an explicit
  collective (``dist.all_reduce``). On the GPU timeline, compute is the span of this rank's
  kernels, and comm is from the moment this rank's own work was done to the moment the collective
  finished: the time it waited for its peers plus the transfer. In synchronous training every
  rank's step is equally long, but the slow rank's compute is the longest and its wait the
  shortest (everyone else waits for it).
* DDP overlaps the gradient all-reduce with backward, so a span around ``loss.backward()`` holds
  both. ``ddp.register_comm_hook(None, timer.ddp_comm_hook())`` marks the moment each gradient
  bucket is ready on this rank (a CUDA event on the compute stream, or the host clock); compute
  then ends at the last bucket's mark and the rest of the ``compute()`` span, until backward
  returns after DDP waited for the last all-reduce, counts as collective wait. Buckets reduced
  while backward still computes cost this rank nothing and are not counted; only the exposed
  wait is, which is what separates the straggler (near zero) from its peers (its lateness).
* FSDP waits for its peers inside forward and backward, at every layer's all-gather and
  reduce-scatter, so no span around them separates compute from waiting. ``timer.watch(*blocks)``
  (called after ``fully_shard``/FSDP wrapping, so FSDP's own pre-forward hook, which all-gathers
  and waits, runs before ours) times only the watched blocks' forward computation, as Megatron's
  own straggler detector times forward ops only; comm is then the rest of the step (backward,
  optimizer and every wait), measured between consecutive ``timer.step()`` calls. Every rank's
  step is equally long, so the slow GPU, whose forward kernels take longest, has the longest
  compute and the shortest rest.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable
from types import TracebackType
from typing import Any

from vigil_heartbeat.client import Heartbeat

# Steps whose GPU events are still in flight; a GPU this far behind the host drops the oldest
# (counted in ``dropped_steps``) rather than grow without bound.
MAX_PENDING_STEPS = 16


class _Span:
    """One compute or comm span of one step: (start, end) marks, plus bucket-ready marks inside a
    compute span (DDP hook)."""

    __slots__ = ("end", "kind", "ready", "start")

    def __init__(self, kind: str, start: Any) -> None:
        self.kind = kind
        self.start = start
        self.end: Any = None
        self.ready: Any = None  # the latest gradient-bucket-ready mark within this span


class _StepMarks:
    __slots__ = ("spans", "step")

    def __init__(self, step: int, spans: list[_Span]) -> None:
        self.step = step
        self.spans = spans


class _Phase:
    __slots__ = ("_kind", "_span", "_timer")

    def __init__(self, timer: StepTimer, kind: str) -> None:
        self._timer = timer
        self._kind = kind
        self._span: _Span | None = None

    def __enter__(self) -> _Phase:
        self._span = self._timer._open(self._kind)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._timer._close(self._span)
        self._span = None


class StepTimer:
    """``timer = StepTimer(hb)``; per step: ``with timer.compute(): ...`` and ``with timer.comm(): ...``
    (or ``compute()`` plus the DDP hook, or ``watch(*blocks)`` once for FSDP), then
    ``timer.step(n)``, which sends the heartbeat.

    ``torch_module`` is the torch module (the seam tests replace); ``use_cuda`` forces CUDA events
    on or off (default: when ``torch.cuda.is_available()``).
    """

    def __init__(self, hb: Heartbeat, *, torch_module: Any = None, use_cuda: bool | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if torch_module is None:
            import torch as torch_module  # only a process that uses it pays for torch
        self._torch = torch_module
        self._hb = hb
        self._clock = clock
        if use_cuda is None:
            try:
                use_cuda = bool(torch_module.cuda.is_available())
            except Exception:  # noqa: BLE001 - no CUDA answer means the host clock
                use_cuda = False
        self.timing = "cuda_events" if use_cuda else "cpu"
        self._cuda = use_cuda
        self._spans: list[_Span] = []
        self._open_span: _Span | None = None
        self._pending: deque[_StepMarks] = deque()
        self._data_seconds = 0.0
        self.last_resolved: tuple[int, float, float] | None = None  # (step, compute s, comm s)
        self.dropped_steps = 0
        self._watching = False
        self._depth = 0  # nesting of watched modules' forwards (an outer block times its inner ones)
        self._step_mark: Any = None  # the previous step's end, in watch mode
        self._hooks: list[Any] = []
        self._watched: _Span | None = None

    # --- marks --------------------------------------------------------------------------------

    def _mark(self) -> Any:
        if not self._cuda:
            return self._clock()
        event = self._torch.cuda.Event(enable_timing=True)
        event.record()  # on the current stream: passed when the work queued before it is done
        return event

    def _open(self, kind: str) -> _Span | None:
        try:
            span = _Span(kind, self._mark())
            self._open_span = span if kind == "compute" else self._open_span
            return span
        except Exception:  # noqa: BLE001 - timing must never stop training
            return None

    def _close(self, span: _Span | None) -> None:
        if span is None:
            return
        with contextlib.suppress(Exception):
            span.end = self._mark()
            self._spans.append(span)
        if self._open_span is span:
            self._open_span = None

    def compute(self) -> _Phase:
        return _Phase(self, "compute")

    def comm(self) -> _Phase:
        return _Phase(self, "comm")

    def bucket_ready(self) -> None:
        """Mark that a gradient bucket is ready on this rank (called by the DDP hook)."""
        span = self._open_span
        if span is not None:
            with contextlib.suppress(Exception):  # timing must never stop training
                span.ready = self._mark()

    def ddp_comm_hook(self, inner: Callable[[Any, Any], Any] | None = None) -> Callable[[Any, Any], Any]:
        """A DDP communication hook: marks each bucket ready, then reduces it with ``inner``
        (default: PyTorch's own ``allreduce_hook``, the same reduction DDP does without a hook)."""
        if inner is None:
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
            inner = allreduce_hook

        def hook(state, bucket):  # unannotated: DDP rejects annotations other than its own types
            self.bucket_ready()
            return inner(state, bucket)

        return hook

    def watch(self, *modules: Any) -> None:
        """Time the forward of these modules (e.g. the transformer blocks, after FSDP wrapping)
        as compute; comm becomes the rest of each step. Registers forward hooks on them."""
        self._watching = True
        for module in modules:
            self._hooks.append(module.register_forward_pre_hook(self._forward_pre))
            self._hooks.append(module.register_forward_hook(self._forward_post))

    def _forward_pre(self, module: Any, args: Any) -> None:
        self._depth += 1
        if self._depth == 1:
            self._watched = self._open("compute")
        if self._step_mark is None:
            with contextlib.suppress(Exception):
                self._step_mark = self._mark()  # the first step starts at its first forward

    def _forward_post(self, module: Any, args: Any, output: Any) -> None:
        self._depth = max(0, self._depth - 1)
        if self._depth == 0:
            self._close(self._watched)
            self._watched = None

    # --- data loading is host work ------------------------------------------------------------

    def data(self) -> _DataTimer:
        return _DataTimer(self)

    # --- the step -----------------------------------------------------------------------------

    def step(self, step: int, *, loss: Any = None, grad_norm: Any = None) -> None:
        """End of step ``step``: queue its marks, resolve every completed earlier step without
        waiting, and send the heartbeat with the latest resolved compute and comm times, and the
        step's ``loss`` and ``grad_norm`` when given (``Heartbeat.step``: a float costs nothing,
        a CUDA tensor one ``.item()``, which waits for the GPU)."""
        self._depth, self._watched = 0, None  # a forward that raised never ran its post-hook
        if self._watching and self._step_mark is not None:
            with contextlib.suppress(Exception):
                end = self._mark()
                whole = _Span("step", self._step_mark)
                whole.end = end
                self._spans.append(whole)
                self._step_mark = end
        marks = _StepMarks(step, self._spans)
        self._spans = []
        data, self._data_seconds = self._data_seconds, 0.0
        self._pending.append(marks)
        while len(self._pending) > MAX_PENDING_STEPS:
            self._pending.popleft()
            self.dropped_steps += 1
        try:
            self._resolve()
        except Exception:  # noqa: BLE001
            self._pending.clear()
        compute = comm = None
        if self.last_resolved is not None:
            _, compute, comm = self.last_resolved
        self._hb.step(step, compute_seconds=compute, comm_seconds=comm, data_seconds=data or None,
                      timing=self.timing, loss=loss, grad_norm=grad_norm)

    def _resolve(self) -> None:
        while self._pending:
            marks = self._pending[0]
            if not all(self._done(s.end) for s in marks.spans):
                return  # the GPU has not reached this step's end: read it next time
            self._pending.popleft()
            compute = comm = 0.0
            whole = None
            for s in marks.spans:
                if s.kind == "step":
                    whole = self._seconds(s.start, s.end)
                elif s.kind == "comm":
                    comm += self._seconds(s.start, s.end)
                elif s.ready is not None:
                    compute += self._seconds(s.start, s.ready)
                    comm += self._seconds(s.ready, s.end)
                else:
                    compute += self._seconds(s.start, s.end)
            if whole is not None:
                comm = max(0.0, whole - compute)  # watch mode: the rest of the step
            if marks.spans:
                self.last_resolved = (marks.step, compute, comm)

    def _done(self, mark: Any) -> bool:
        return True if not self._cuda else bool(mark.query())

    def _seconds(self, start: Any, end: Any) -> float:
        if not self._cuda:
            return max(0.0, end - start)
        return max(0.0, start.elapsed_time(end) / 1000.0)  # CUDA reports milliseconds


class _DataTimer:
    __slots__ = ("_start", "_timer")

    def __init__(self, timer: StepTimer) -> None:
        self._timer = timer
        self._start = 0.0

    def __enter__(self) -> _DataTimer:
        self._start = self._timer._clock()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._timer._data_seconds += self._timer._clock() - self._start

"""Recording and replaying NVML: what a real driver answered, call by call.

``RecordingNvml`` wraps the pynvml module and keeps, for every call made through it, the function's
name, its arguments, what it returned (ctypes structs as their fields) or which ``NVMLError`` it
raised, and how long it took. ``ReplayNvml`` serves such a recording back in the order recorded, so
the real ``PynvmlBackend`` runs over a real GPU's answers on a machine without one
(tests/agent/nvml/test_replay.py). Neither interprets a value or touches hardware other than
through the wrapped module; scripts/record-real-gpu.py makes the recordings.
"""

from __future__ import annotations

import ctypes
import json
import math
import time
from collections import defaultdict, deque
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml

# A recording's format: bumped when the encoding below changes (ReplayNvml refuses other versions).
RECORDING_FORMAT = 1

# c_nvmlFieldValue_t.value is a union: the member that holds the value, by valueType (NVML API
# reference, nvmlValueType_t).
_FIELD_MEMBER = {
    pynvml.NVML_VALUE_TYPE_DOUBLE: "dVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
    pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
    pynvml.NVML_VALUE_TYPE_SIGNED_INT: "siVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT: "usVal",
}
# Calls that take or return a GPM sample buffer, an event set or a GPM request: encoded by kind,
# not by address, so a replay in the same order matches whatever addresses it allocates.
_SAMPLE = {"$sample": True}
_EVENT_SET = {"$event_set": True}
# Calls that fill a struct the caller passes (the fabric info): the argument is recorded by its type,
# the struct as the call left it as the result; a replay writes those fields into the caller's struct.
_FILLS_STRUCT = frozenset({"nvmlDeviceGetGpuFabricInfoV", "nvmlDeviceGetGpuFabricInfo"})


def _address(value: Any) -> int | None:
    try:
        return ctypes.cast(value, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return None


def _identity(value: Any) -> int:
    """What names an opaque object between calls: a ctypes pointer's address (pynvml), else the
    object itself (FakeNvml's handles and event sets, which RecordingNvml keeps alive)."""
    address = _address(value)
    return id(value) if address is None else address


class RecordingNvml:
    """The pynvml module, with every function call recorded in ``calls``. Constants, classes and
    exceptions pass through untouched."""

    def __init__(self, nvml: Any = pynvml, clock: Callable[[], float] = time.perf_counter) -> None:
        self._nvml = nvml
        self._clock = clock
        self.calls: list[dict[str, Any]] = []
        self._handles: dict[int, int] = {}  # handle identity -> GPU index
        self._samples: set[int] = set()  # identities of GPM sample buffers allocated through us
        self._event_sets: set[int] = set()
        self._alive: list[Any] = []  # the opaque objects above, so that an id is never reused

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._nvml, name)
        if not callable(value) or isinstance(value, type) or not name.startswith("nvml"):
            return value

        def call(*args: Any) -> Any:
            return self._call(name, value, args)

        return call

    # --- encoding ------------------------------------------------------------------------------

    def encode(self, value: Any) -> Any:
        """A JSON value for ``value``: handles, samples and event sets by kind, structs as dicts."""
        if value is None or isinstance(value, bool | int | str):
            return value
        if isinstance(value, float):
            return value if math.isfinite(value) else repr(value)
        if isinstance(value, bytes):  # kept apart from str: the backend must cope with either
            return {"$bytes": value.decode(errors="replace")}
        if isinstance(value, list | tuple):
            return [self.encode(v) for v in value]
        if isinstance(value, pynvml.c_nvmlGpmMetricsGet_t):
            return {"$gpm_request": [int(value.metrics[i].metricId) for i in range(value.numMetrics)]}
        if isinstance(value, pynvml.c_nvmlFieldValue_t):
            return {"fieldId": int(value.fieldId), "scopeId": int(value.scopeId),
                    "nvmlReturn": int(value.nvmlReturn), "valueType": int(value.valueType),
                    "value": self.encode(getattr(value.value, _FIELD_MEMBER.get(value.valueType, "uiVal")))}
        ident = _identity(value)
        if ident in self._handles:
            return {"$handle": self._handles[ident]}
        if ident in self._samples:
            return _SAMPLE
        if ident in self._event_sets:
            return _EVENT_SET
        if isinstance(value, ctypes.Array):
            return [self.encode(v) for v in value]
        if isinstance(value, ctypes.Structure | ctypes.Union):
            return {name: self.encode(getattr(value, name)) for name, *_ in value._fields_}
        if _address(value) is not None:
            return {"$pointer": None}
        fields = getattr(value, "__dict__", None)  # a plain object standing in for a struct (FakeNvml's)
        if fields:
            return {k: self.encode(v) for k, v in fields.items() if not k.startswith("_")}
        return repr(value)

    def _call(self, name: str, function: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        encoded_args = self.encode(list(args))
        if name in _FILLS_STRUCT:  # args[1] is ctypes.byref(struct)
            encoded_args = [encoded_args[0], {"$struct": type(getattr(args[1], "_obj", args[1])).__name__}]
        started = self._clock()
        entry: dict[str, Any] = {"call": name, "args": encoded_args}
        try:
            result = function(*args)
        except pynvml.NVMLError as exc:
            entry["seconds"] = self._clock() - started
            entry["error"] = type(exc).__name__
            entry["error_value"] = int(exc.value) if isinstance(getattr(exc, "value", None), int) else None
            self.calls.append(entry)
            raise
        entry["seconds"] = self._clock() - started
        if name in ("nvmlDeviceGetHandleByIndex", "nvmlGpmSampleAlloc", "nvmlEventSetCreate"):
            self._alive.append(result)
            ident = _identity(result)
            if name == "nvmlDeviceGetHandleByIndex":
                self._handles[ident] = int(args[0])
            elif name == "nvmlGpmSampleAlloc":
                self._samples.add(ident)
            else:
                self._event_sets.add(ident)
        if name == "nvmlGpmMetricsGet":  # the answer is written into the request's slots
            request = args[0]
            entry["result"] = {"metrics": [
                {"metricId": int(request.metrics[i].metricId), "nvmlReturn": int(request.metrics[i].nvmlReturn),
                 "value": self.encode(float(request.metrics[i].value))} for i in range(request.numMetrics)]}
        elif name in _FILLS_STRUCT:
            entry["result"] = {"$filled": self.encode(getattr(args[1], "_obj", args[1]))}
        else:
            entry["result"] = self.encode(result)
        self.calls.append(entry)
        return result


def _key(name: str, args: Any) -> str:
    return name + json.dumps(args, sort_keys=True)


class _Record(SimpleNamespace):
    """A recorded struct: its fields as attributes (what the backend reads of a pynvml struct)."""


class ReplayHandle:
    def __init__(self, index: int) -> None:
        self.index = index


def _decode(value: Any, handles: dict[int, ReplayHandle]) -> Any:
    if isinstance(value, list):
        return [_decode(v, handles) for v in value]
    if isinstance(value, dict):
        if "$bytes" in value:
            return str(value["$bytes"]).encode()
        if "$handle" in value:
            return handles.setdefault(int(value["$handle"]), ReplayHandle(int(value["$handle"])))
        if "fieldId" in value and "valueType" in value:  # a field value: the union as all members
            member = _FIELD_MEMBER.get(value["valueType"], "uiVal")
            union = _Record(**{m: 0 for m in _FIELD_MEMBER.values()})
            setattr(union, member, value["value"])
            return _Record(**{**value, "value": union})
        return _Record(**{k: _decode(v, handles) for k, v in value.items()})
    return value


class ReplayNvml:
    """Serves a recording: each call with the same name and arguments gets the answers recorded
    for it, in order; past the last, the last again. A call never recorded raises an
    AttributeError naming it, so a backend that starts
    asking something new is noticed."""

    def __init__(self, recording: dict[str, Any]) -> None:
        if recording.get("format") != RECORDING_FORMAT:
            raise ValueError(f"recording format {recording.get('format')!r}, this reader knows {RECORDING_FORMAT}")
        self.recording = recording
        self._answers: dict[str, deque[dict[str, Any]]] = defaultdict(deque)
        for entry in recording["calls"]:
            self._answers[_key(entry["call"], entry["args"])].append(entry)
        self._handles: dict[int, ReplayHandle] = {}
        # GPM sample buffers handed out, by address: real c_nvmlGpmSample_t pointers, because the
        # backend sets them into a real c_nvmlGpmMetricsGet_t.
        self._samples: dict[int, ctypes.Array[ctypes.c_char]] = {}
        self.asked: list[str] = []

    @classmethod
    def load(cls, path: str | Path) -> ReplayNvml:
        return cls(json.loads(Path(path).read_text()))

    def __getattr__(self, name: str) -> Any:
        value = getattr(pynvml, name)
        if callable(value) and not isinstance(value, type) and name.startswith("nvml"):
            def call(*args: Any) -> Any:
                return self._call(name, args)
            return call
        return value

    def _encode_arg(self, value: Any) -> Any:
        if isinstance(value, ReplayHandle):
            return {"$handle": value.index}
        if isinstance(value, pynvml.c_nvmlGpmSample_t) and _address(value) in self._samples:
            return _SAMPLE
        if isinstance(value, _ReplayEventSet):
            return _EVENT_SET
        if isinstance(value, pynvml.c_nvmlGpmMetricsGet_t):
            return {"$gpm_request": [int(value.metrics[i].metricId) for i in range(value.numMetrics)]}
        if isinstance(getattr(value, "_obj", value), ctypes.Structure):  # a struct, or ctypes.byref of one
            return {"$struct": type(getattr(value, "_obj", value)).__name__}
        if isinstance(value, list | tuple):
            return [self._encode_arg(v) for v in value]
        return value

    def _call(self, name: str, args: tuple[Any, ...]) -> Any:
        key = _key(name, self._encode_arg(list(args)))
        queue = self._answers.get(key)
        if not queue:
            raise AttributeError(f"the recording has no answer for {name}{tuple(self._encode_arg(list(args)))}")
        entry = queue.popleft() if len(queue) > 1 else queue[0]
        self.asked.append(name)
        if "error" in entry:
            raise getattr(pynvml, entry["error"], pynvml.NVMLError_Unknown)()
        result = entry["result"]
        if name == "nvmlGpmSampleAlloc":
            buffer = ctypes.create_string_buffer(16)
            pointer = ctypes.cast(buffer, pynvml.c_nvmlGpmSample_t)
            self._samples[_address(pointer) or 0] = buffer
            return pointer
        if name == "nvmlGpmSampleFree":
            self._samples.pop(_address(args[0]) or 0, None)
        if name == "nvmlEventSetCreate":
            return _ReplayEventSet()
        if name in _FILLS_STRUCT:
            struct = getattr(args[1], "_obj", args[1])
            for field, value in result["$filled"].items():
                if isinstance(value, list):  # an array field (the fabric's cluster UUID bytes)
                    getattr(struct, field)[:] = value
                else:
                    ctypes.Structure.__setattr__(struct, field, value)
            return pynvml.NVML_SUCCESS
        if name == "nvmlGpmMetricsGet":
            request = args[0]
            for i, metric in enumerate(result["metrics"]):
                request.metrics[i].nvmlReturn = metric["nvmlReturn"]
                request.metrics[i].value = float(metric["value"])
            return request
        return _decode(result, self._handles)


class _ReplayEventSet:
    pass

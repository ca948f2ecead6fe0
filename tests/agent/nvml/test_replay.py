"""The backend over real GPUs' recorded NVML answers (an H100 in tests/fixtures/nvml-real/, an H200
in tests/fixtures/nvml-real-h200/): every backend call made on the real GPU, replayed through
``ReplayNvml``, gives what it gave there, so a change to the backend's conversions, error handling or
call pattern is checked against real hardware on a machine without one. scripts/record-real-gpu.py
makes the recordings; each folder's PROVENANCE.md says where."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from vigil.agent.nvml.backend import PynvmlBackend
from vigil.agent.nvml.recording import RECORDING_FORMAT, RecordingNvml, ReplayNvml
from vigil.agent.nvml.scenario import load_node_scenario

from .conftest import RealGpu


@pytest.fixture(scope="module")
def recording(real_gpu: RealGpu) -> dict[str, Any]:
    return json.loads((real_gpu.folder / "nvml-recording.json").read_text())


@pytest.fixture(scope="module")
def ops(real_gpu: RealGpu) -> list[dict[str, Any]]:
    return json.loads((real_gpu.folder / "backend-ops.json").read_text())["ops"]


def _as_json(value: Any) -> Any:
    """What scripts/record-real-gpu.py stored for a backend result (dataclasses as dicts)."""
    import dataclasses

    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _as_json(dataclasses.asdict(value))
    if isinstance(value, dict):
        return {k: _as_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_as_json(v) for v in value]
    return value


# Fields the backend's dataclasses gained after the recording (issue 46: the AMD backend fills them),
# with the value NVML's backend always gives them: a recorded result lacks them.
_ADDED_SINCE_RECORDING = {"vendor": "nvidia", "ecc_deferred_volatile": None, "xgmi_corrected_errors": None,
                          "xgmi_uncorrected_errors": None, "edge_temperature_celsius": None, "ecc_blocks": []}


def _same(got: Any, want: Any, where: str) -> None:
    if isinstance(want, dict):
        assert isinstance(got, dict), where
        for key in got.keys() - want.keys():
            assert key in _ADDED_SINCE_RECORDING and got[key] == _ADDED_SINCE_RECORDING[key], (where, key, got[key])
        got = {k: v for k, v in got.items() if k in want}
        assert got.keys() == want.keys(), where
        for key in want:
            _same(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _same(g, w, f"{where}[{i}]")
    elif isinstance(want, float):
        assert isinstance(got, float) and math.isclose(got, want, rel_tol=1e-12), (where, got, want)
    else:
        assert got == want, (where, got, want)


def replay(recording: dict[str, Any], ops: list[dict[str, Any]]) -> tuple[ReplayNvml, list[tuple[dict, Any]]]:
    nvml = ReplayNvml(recording)
    # ReplayNvml and RecordingNvml stand in for the pynvml module (through __getattr__), which
    # PynvmlBackend's annotation (ModuleType | FakeNvml) does not name.
    backend = PynvmlBackend(nvml)  # type: ignore[arg-type]  # duck-typed pynvml module
    out = []
    for op in ops:
        try:
            result: Any = getattr(backend, op["op"])(*op["args"], **op["kwargs"])
        except Exception as exc:  # noqa: BLE001 - compared with what the real GPU raised
            result = {"raises": type(exc).__name__}
        out.append((op, result))
    return nvml, out


def test_the_recording_is_a_real_hopper_gpu(real_gpu, recording, ops) -> None:
    assert recording["format"] == RECORDING_FORMAT
    identity = next(op["result"] for op in ops if op["op"] == "identity")
    assert identity["name"] == real_gpu.profile.name and identity["uuid"].startswith("GPU-")
    phases = {op["phase"] for op in ops if op["op"] == "read"}
    assert phases == {"idle", "tensor", "memory"}  # idle, a tensor-core load and a memory-bound load


def test_backend_over_the_replay_gives_what_it_gave_on_the_real_gpu(recording, ops) -> None:
    _nvml, results = replay(recording, ops)
    for i, (op, got) in enumerate(results):
        where = f"op {i} {op['phase']} {op['op']}{tuple(op['args'])}"
        if "raises" in op:
            assert got == {"raises": op["raises"]}, where
        else:
            _same(_as_json(got), op["result"], where)


def test_backend_asks_only_what_the_real_gpu_was_asked(recording, ops) -> None:
    """A call the backend starts making is unknown to the recording (ReplayNvml raises for it, and
    the read would count an error): record again on a real GPU (scripts/record-real-gpu.py)."""
    nvml, results = replay(recording, ops)
    reads = [got for op, got in results if op["op"] == "read"]
    assert reads and all(r.errors == [] for r in reads)
    assert set(nvml.asked) == {c["call"] for c in recording["calls"]}


def test_real_gpu_readings_under_load(ops) -> None:
    """What the recording shows, as the exporter sees it: GPM separates a tensor-bound job from a
    memory-bound one, and a healthy GPU at full tensor load runs power-capped below its top clock."""
    reads = [op for op in ops if op["op"] == "read"]

    def steady(phase: str, field: str) -> float:
        values = sorted(op["result"][field] for op in reads[1:] if op["phase"] == phase
                        and op["result"][field] is not None)
        return values[len(values) // 2]

    assert steady("tensor", "tensor_active_ratio") > 0.8 and steady("tensor", "dram_active_ratio") < 0.4
    assert steady("memory", "dram_active_ratio") > 0.8 and steady("memory", "tensor_active_ratio") < 0.05
    assert steady("idle", "sm_active_ratio") == 0.0
    # SwPowerCap (bit 0x4) at 0.71-0.80 of the 1980 MHz boost clock (H100; the H200 0.70-0.73), 98-99%
    # of the 700 W limit.
    tensor = [op["result"] for op in reads[1:] if op["phase"] == "tensor"]
    assert all(r["clock_event_reasons"] & 0x4 for r in tensor[1:])
    assert 0.6 < steady("tensor", "sm_clock_hertz") / 1.98e9 < 0.85
    assert steady("tensor", "power_watts") > 0.95 * 700
    # PCIe throughput from GPM on a Hopper GPU: present from the second read of each GPU on.
    assert all(op["result"]["pcie_tx_bytes_per_second"] is not None for op in reads[1:])


def test_recording_over_the_fake_replays_too(clock) -> None:
    """RecordingNvml and ReplayNvml round-trip over FakeNvml: the same machinery as on the real GPU."""
    from vigil.agent.nvml.fake import FakeNvml

    recorder = RecordingNvml(FakeNvml(load_node_scenario("healthy-h100"), clock, start=0.0))
    live = PynvmlBackend(recorder)  # type: ignore[arg-type]  # duck-typed pynvml module
    live.init()
    want = [_as_json(live.identity(i)) for i in range(live.device_count())]
    want += [_as_json(live.config_facts(i)) for i in range(8)]
    for _ in range(3):
        clock.t += 2.0
        want += [_as_json(live.read(i)) for i in range(8)]
    live.shutdown()
    replayed = ReplayNvml(json.loads(json.dumps({"format": RECORDING_FORMAT, "calls": recorder.calls})))
    again = PynvmlBackend(replayed)  # type: ignore[arg-type]  # duck-typed pynvml module
    again.init()
    got = [_as_json(again.identity(i)) for i in range(again.device_count())]
    got += [_as_json(again.config_facts(i)) for i in range(8)]
    for _ in range(3):
        got += [_as_json(again.read(i)) for i in range(8)]
    again.shutdown()
    _same(got, want, "fake")


def test_an_unprivileged_agent_is_refused_nothing(real_gpu, recording) -> None:
    """The same backend calls made as uid/gid 65534 with no groups (an agent in a container without
    privileges), on the same GPU: every call answers as it did for root, the Xid event registration
    included, and the backend over that recording gives what it gave there."""
    unprivileged = json.loads((real_gpu.folder / "nvml-unprivileged.json").read_text())
    assert unprivileged["uid"] == unprivileged["gid"] == 65534

    def outcomes(calls: list[dict[str, Any]]) -> dict[str, set[str]]:
        seen: dict[str, set[str]] = {}
        for c in calls:
            seen.setdefault(c["call"], set()).add(c.get("error", "ok"))
        return seen

    as_root, as_user = outcomes(recording["calls"]), outcomes(unprivileged["calls"])
    assert as_user == {call: as_root[call] for call in as_user}
    assert not any("NoPermission" in c.get("error", "") for c in unprivileged["calls"])
    assert unprivileged["events_registered"] == [0]
    _nvml, results = replay(unprivileged, unprivileged["ops"])
    for i, (op, got) in enumerate(results):
        if "raises" in op:
            assert got == {"raises": op["raises"]}, i
        else:
            _same(_as_json(got), op["result"], f"unprivileged op {i} {op['op']}")
    reads = [got for op, got in results if op["op"] == "read"]
    assert reads and all(r.errors == [] and r.health == "ok" for r in reads)


def test_the_recording_script_rehearses_its_unprivileged_probe(tmp_path) -> None:
    """scripts/record-real-gpu.py's unprivileged probe runs from a copy of the code: a module the
    copy leaves out fails only there, on the lease (it did on the H200's, 2026-11-27). Rehearsed
    over FakeNvml, the copy must import, from itself alone (the child refuses a module of vigil's
    found outside it, as this checkout's editable install would hide a missing one), and record
    the probe's calls (as this user: the privilege drop itself needs the GPU node)."""
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), str(repo / "clients" / "heartbeat")])}
    done = subprocess.run([sys.executable, str(repo / "scripts" / "record-real-gpu.py"), str(tmp_path),
                           "--rehearse", "--unprivileged-only"],
                          capture_output=True, text=True, timeout=120, check=False, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    probe = json.loads((tmp_path / "nvml-unprivileged.json").read_text())
    if "skipped" in probe:  # not root: the script makes no copy to probe from
        pytest.skip(probe["skipped"])
    assert probe["format"] == RECORDING_FORMAT and probe["events_registered"] == list(range(8))
    assert {op["op"] for op in probe["ops"]} >= {"init", "identity", "read", "running_pids", "open_events"}
    assert {c["call"] for c in probe["calls"]} >= {"nvmlInit", "nvmlDeviceGetUUID", "nvmlEventSetCreate"}

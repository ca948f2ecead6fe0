"""PynvmlBackend's NVLink reads follow _query's rules per call: NotSupported makes the query absent
and never asked again, another error is recorded and the other links still read, a health error
makes the whole reading that health."""

from __future__ import annotations

import random
from typing import Any

import pynvml
import pytest

from vigil.agent.nvml.backend import GpuReading, NvLinkReading, PynvmlBackend
from vigil.agent.nvml.fake import FakeNvml
from vigil.agent.nvml.scenario import DEFAULT_SCENARIO, parse_node_scenario


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class FaultyLinks(FakeNvml):
    """Link 2's replay counter fails with Unknown; the state query answers NotSupported once it is
    told to; GPU 1's link 5 is lost. Counts the calls."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.state_not_supported = False
        self.state_calls = 0
        self.lost_link_from = float("inf")

    def nvmlDeviceGetNvLinkState(self, handle: Any, link: int) -> int:
        self.state_calls += 1
        if self.state_not_supported:
            raise pynvml.NVMLError_NotSupported()
        if handle.index == 1 and link == 5 and self.now() >= self.lost_link_from:
            raise pynvml.NVMLError_GpuIsLost()
        return super().nvmlDeviceGetNvLinkState(handle, link)

    def nvmlDeviceGetNvLinkErrorCounter(self, handle: Any, link: int, counter: int) -> int:
        if link == 2 and counter == pynvml.NVML_NVLINK_ERROR_DL_REPLAY:
            raise pynvml.NVMLError_Unknown()
        return super().nvmlDeviceGetNvLinkErrorCounter(handle, link, counter)


def test_nvlink_errors_follow_the_query_rules() -> None:
    clock = Clock()
    fake = FaultyLinks(DEFAULT_SCENARIO, clock, start=0.0)
    backend = PynvmlBackend(fake)
    backend.init()
    links = backend.identity(0).nvlinks
    assert len(links) == 18
    r = backend.read(0)
    assert r.health == "ok"
    assert [(n.link, n.active, n.crc_errors, n.replay_errors, n.recovery_errors) for n in r.nvlinks] == [
        (link, True, 0, None if link == 2 else 0, 0) for link in links]
    assert r.errors == [("nvmlDeviceGetNvLinkErrorCounter", "unknown")]

    fake.state_not_supported = True
    calls = fake.state_calls
    r = backend.read(0)
    assert fake.state_calls == calls + 1  # asked once, then known unsupported for the other links
    assert [n.active for n in r.nvlinks] == [None] * 18
    assert [n.crc_errors for n in r.nvlinks] == [0] * 18
    r = backend.read(0)
    assert fake.state_calls == calls + 1 and [n.active for n in r.nvlinks] == [None] * 18

    fake.state_not_supported = False
    fake.lost_link_from = 1.0  # GPU 1 named while all its links answer; its link 5 lost later
    assert len(backend.identity(1).nvlinks) == 18
    clock.t = 2.0
    lost = backend.read(1)
    assert (lost.health, lost.nvlinks, lost.errors) == ("lost", (), [("device", "gpu_is_lost")])
    assert backend.read(1, slow=False).health == "ok"  # no NVLink query, so nothing lost this time


class RandomlyFailingLinks(FakeNvml):
    """Every NVLink call may fail, drawn from a seeded stream: NotSupported (rarely), another error,
    or a lost GPU (rarer). Logs each call it is asked, so two backends' calls can be compared."""

    def __init__(self, *args: Any, rng_seed: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rng = random.Random(rng_seed)
        self.calls: list[tuple[Any, ...]] = []

    def _maybe_fail(self) -> None:
        roll = self.rng.random()
        if roll < 0.004:
            raise pynvml.NVMLError_NotSupported()
        if roll < 0.02:
            raise self.rng.choice((pynvml.NVMLError_Unknown, pynvml.NVMLError_InvalidArgument,
                                   pynvml.NVMLError_Timeout))()
        if roll < 0.021:
            raise pynvml.NVMLError_GpuIsLost()

    def nvmlDeviceGetNvLinkState(self, handle: Any, link: int) -> int:
        self.calls.append(("state", handle.index, link))
        self._maybe_fail()
        return super().nvmlDeviceGetNvLinkState(handle, link)

    def nvmlDeviceGetNvLinkErrorCounter(self, handle: Any, link: int, counter: int) -> int:
        self.calls.append(("counter", handle.index, link, counter))
        self._maybe_fail()
        return super().nvmlDeviceGetNvLinkErrorCounter(handle, link, counter)


class LongWayBackend(PynvmlBackend):
    """The NVLink read as _query's rules state it, one _query a call: what the inlined read must equal."""

    def _read_nvlinks(self, index: int, e: list[tuple[str, str]], h: Any,
                      links: tuple[int, ...]) -> tuple[NvLinkReading, ...]:
        enabled = pynvml.NVML_FEATURE_ENABLED
        out = []
        for link in links:
            state = self._query(index, e, "nvmlDeviceGetNvLinkState", h, link)
            counters = [self._query(index, e, "nvmlDeviceGetNvLinkErrorCounter", h, link, c)
                        for c in (pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT, pynvml.NVML_NVLINK_ERROR_DL_REPLAY,
                                  pynvml.NVML_NVLINK_ERROR_DL_RECOVERY)]
            out.append(NvLinkReading(link, None if state is None else state == enabled, *counters))
        return tuple(out)


@pytest.mark.parametrize("seed", range(8))
def test_the_inlined_nvlink_read_equals_the_long_way_under_random_failures(seed: int) -> None:
    _compare_with_the_long_way(seed)


def _compare_with_the_long_way(seed: int) -> set[str]:
    """Over evolving NVLink errors, links going down and calls failing at random (NotSupported
    remembered, errors counted, lost GPUs), the backend's read asks the same calls in the same order
    and answers the same readings, errors and remembered capabilities as one _query a call."""
    rng = random.Random(seed)
    faults: list[dict[str, Any]] = []
    for _ in range(rng.randint(2, 10)):
        gpu, link = rng.randrange(8), rng.randrange(18)
        faults.append(rng.choice((
            {"kind": "nvlink_errors", "gpu": gpu, "link": link, "at_seconds": rng.uniform(0, 600),
             "rate_per_second": rng.uniform(0.01, 5.0), "error_type": rng.choice(("crc", "replay", "recovery"))},
            {"kind": "nvlink_down", "gpu": gpu, "link": link, "at_seconds": rng.uniform(0, 600)})))
    scenario = parse_node_scenario({"profile": "h100-sxm-80gb", "gpus": 8, "faults": faults})
    clocks = Clock(), Clock()
    fakes = [RandomlyFailingLinks(scenario, c, start=0.0, seed=seed, rng_seed=seed) for c in clocks]
    fast, slow = PynvmlBackend(fakes[0]), LongWayBackend(fakes[1])
    for b in (fast, slow):
        b.init()
    seen: set[str] = set()
    for _ in range(30):
        step = rng.choice((10.0, 60.0, 300.0))
        for c in clocks:
            c.t += step
        for index in range(8):
            got = [_read(b, index) for b in (fast, slow)]
            assert got[0] == got[1]
            assert fakes[0].calls == fakes[1].calls
            if isinstance(got[0], GpuReading):
                seen |= {reason for _, reason in got[0].errors}
                seen |= {"lost"} if got[0].health == "lost" else set()
        assert fast._unsupported == slow._unsupported
    seen |= {"not_supported"} if any(fast._unsupported.values()) else set()
    return seen


def _read(backend: PynvmlBackend, index: int) -> GpuReading | str:
    try:
        backend.identity(index)
    except pynvml.NVMLError as exc:
        return type(exc).__name__
    return backend.read(index)


def test_the_random_failures_reach_every_rule() -> None:
    seen: set[str] = set()
    for seed in range(8):
        seen |= _compare_with_the_long_way(seed)
    assert {"unknown", "timeout", "invalid_argument", "gpu_is_lost", "lost", "not_supported"} <= seen

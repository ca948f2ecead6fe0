"""PynvmlBackend's NVLink reads follow _query's rules per call: NotSupported makes the query absent
and never asked again, another error is recorded and the other links still read, a health error
makes the whole reading that health."""

from __future__ import annotations

from typing import Any

import pynvml

from vigil.agent.nvml.backend import PynvmlBackend
from vigil.agent.nvml.fake import FakeNvml
from vigil.agent.nvml.scenario import DEFAULT_SCENARIO


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

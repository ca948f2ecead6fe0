"""A collector that stays broken logs once, not every cycle (issue 41: a missing kernel log file
logged a WARNING every 0.5 s): a failure is logged when it starts or changes and the recovery once;
every failed cycle is counted in ``vigil_collector_failures_total{collector, reason}``. Through the
real agent's runner and xid collector, on an injected clock and kmsg path."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tests.agent.test_agent_integration import START, FakeClock
from vigil.agent.collectors.collector import Collection, Collector
from vigil.agent.config import parse_config
from vigil.agent.daemon import Agent
from vigil.agent.nvml.backend import PynvmlBackend
from vigil.agent.nvml.fake import FakeNvml
from vigil.agent.nvml.scenario import load_node_scenario
from vigil.agent.runner import Runner
from vigil.agent.snapshot import Snapshot
from vigil.contract.seams import Seams

XID_CYCLE_SECONDS = 0.5  # collectors.xid.interval_seconds' default
XID_LINE = ("[ 1234.567890] NVRM: Xid (PCI:0000:19:00): 79, pid='<unknown>', name=<unknown>, "
            "GPU has fallen off the bus.\n")


def _warnings(caplog: pytest.LogCaptureFixture, collector: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "vigil.agent.runner" and r.levelno >= logging.WARNING and f"collector {collector} " in
            r.getMessage()]


def _failures(runner: Runner) -> dict[tuple[str, str], float]:
    return {(s.label("collector") or "", s.label("reason") or ""): s.value for s in runner.self_samples()
            if s.name == "vigil_collector_failures_total"}


def test_a_missing_kmsg_file_logs_once_counts_every_cycle_and_logs_its_arrival(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    kmsg = tmp_path / "kmsg.log"  # not there yet
    clock = FakeClock(START)
    config = parse_config({"node": "n1", "nvml": {"backend": "fake", "scenario": "healthy-h100"},
                           "collectors": {"gpu": {"xid_events": False}}})
    backend = PynvmlBackend(FakeNvml(load_node_scenario("healthy-h100"), clock, start=START))
    backend.init()
    agent = Agent(config, Seams(nvml=backend, clock=clock, kmsg=str(kmsg), sysfs_root=tmp_path / "no-sysfs",
                                state_dir=tmp_path))
    xid = next(c for c in agent.collectors if c.name == "xid")
    try:
        with caplog.at_level(logging.INFO, logger="vigil.agent.runner"):
            for _ in range(20):  # ten seconds of cycles
                assert not agent.runner.cycle(xid).success
                clock.t += XID_CYCLE_SECONDS
            warned = _warnings(caplog, "xid")
            assert len(warned) == 1 and str(kmsg) in warned[0]
            assert _failures(agent.runner) == {("xid", "FileNotFoundError"): 20}
            assert agent.snapshot.failed() == ["xid"]  # still a failed collector: Xids are not seen

            kmsg.write_text(XID_LINE)  # it appears: read from its beginning, the recovery logged once
            caplog.clear()
            assert agent.runner.cycle(xid).success
            recovered = [r.getMessage() for r in caplog.records if "recovered" in r.getMessage()]
            assert len(recovered) == 1 and "collector xid recovered" in recovered[0]
            xids = [s for s in agent.snapshot.samples() if s.name == "vigil_gpu_xid_errors_total" and s.value]
            assert [s.label("code") for s in xids] == ["79"]

            kmsg.unlink()  # it disappears once open: followed like tail -F, the open file read on
            for _ in range(4):
                clock.t += XID_CYCLE_SECONDS
                assert agent.runner.cycle(xid).success
            assert _warnings(caplog, "xid") == []
            assert _failures(agent.runner) == {("xid", "FileNotFoundError"): 20}
    finally:
        for c in agent.collectors:
            c.close()


class _Failing(Collector):
    name = "flaky"

    def __init__(self) -> None:
        self.error: Exception | None = OSError("sensor unreadable")

    def collect(self, now: float) -> Collection:
        if self.error is not None:
            raise self.error
        return Collection()

    def close(self) -> None:
        pass


def test_a_failure_that_changes_is_logged_again(caplog: pytest.LogCaptureFixture) -> None:
    """The lookalike: a different failure, or the same one after a recovery, is news and is logged."""
    c = _Failing()
    runner = Runner([c], {}, Snapshot(), on_events=lambda _: None, clock=lambda: START)
    with caplog.at_level(logging.INFO, logger="vigil.agent.runner"):
        runner.cycle(c)
        runner.cycle(c)
        c.error = ValueError("bad value")
        runner.cycle(c)
        c.error = None
        runner.cycle(c)
        c.error = ValueError("bad value")
        runner.cycle(c)
    assert len(_warnings(caplog, "flaky")) == 3
    assert _failures(runner) == {("flaky", "OSError"): 2, ("flaky", "ValueError"): 2}

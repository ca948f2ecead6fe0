"""Assembles the agent from its configuration and runs it until told to stop.

It builds the real seams (NVML backend, sysfs root, kernel log, command runner, clock), the
collectors named in the registry, the runner, the reporter and the server, and owns the one
asyncio loop. It contains no collection logic.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry

import agent
from agent.collectors import REGISTRY
from agent.collectors.collector import Collection, Collector
from agent.config import AgentConfig
from agent.dcgm_compat import DcgmCompatCollector
from agent.exporter import SnapshotExporter, render
from agent.reporter import REPORTER_SPECS, Reporter
from agent.runner import RUNNER_SPECS, Runner
from agent.sd_notify import SdNotifier
from agent.seams import Seams
from agent.server import HeartbeatSink, make_app, split_hostport, start_udp
from agent.snapshot import Snapshot

log = logging.getLogger("vigil.agent")

BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")


def read_boot_id(path: Path = BOOT_ID_PATH) -> str:
    """The kernel's boot id plus a per-start suffix: counters restart when either changes."""
    try:
        kernel = path.read_text().strip().replace("-", "")[:16]
    except OSError:
        kernel = "unknown"
    return f"{kernel}-{secrets.token_hex(4)}"


def open_nvml(config: AgentConfig, clock: Callable[[], float]) -> Any:
    from agent.nvml.backend import open_backend  # pulls in pynvml only when needed

    return open_backend(config.nvml, clock)


def build_collectors(config: AgentConfig, seams: Seams) -> list[Collector]:
    out: list[Collector] = []
    for name, build in REGISTRY.items():
        section = getattr(config.collectors, name)
        if not section.enabled:
            continue
        out.append(build(config, seams))
    return out


class Agent:
    """A running agent's parts, exposed for tests and the demo."""

    def __init__(self, config: AgentConfig, seams: Seams) -> None:
        self.config = config
        self.seams = seams
        self.snapshot = Snapshot()
        self.collectors = build_collectors(config, seams)
        token = None
        if config.aggregator.token_file:
            token = Path(config.aggregator.token_file).read_text().strip()
        self.boot_id = read_boot_id()
        self.reporter = Reporter(
            url=config.aggregator.url, token=token, node=config.node, boot_id=self.boot_id,
            topology=config.topology, snapshot=self.snapshot, interval_seconds=config.aggregator.interval_seconds,
            timeout_seconds=config.aggregator.timeout_seconds,
            max_backoff_seconds=config.aggregator.max_backoff_seconds, clock=seams.clock)
        intervals = {}
        for c in self.collectors:
            section = getattr(config.collectors, c.name)
            intervals[c.name] = (section.interval_seconds, section.timeout_seconds)
        self.runner = Runner(self.collectors, intervals, self.snapshot, self._on_events, clock=seams.clock)
        specs = [s for c in self.collectors for s in c.specs] + [*RUNNER_SPECS, *REPORTER_SPECS]
        self.exporter = SnapshotExporter(specs, [self.snapshot.samples, self.runner.self_samples,
                                                 self.reporter.samples])
        # Add-on prometheus-client collectors (e.g. dcgm-exporter compatibility) register here;
        # vigil's own series are rendered by the exporter's direct encoder.
        self.registry = CollectorRegistry(auto_describe=False)
        if config.exporter.dcgm_compat:
            self.registry.register(DcgmCompatCollector(self.snapshot.samples, hostname=config.node))

    def render_metrics(self) -> bytes:
        return render(self.exporter, self.registry)

    def _on_events(self, collection: Collection) -> None:
        self.reporter.add_events(collection.events)

    def heartbeat_sink(self) -> HeartbeatSink | None:
        for c in self.collectors:
            if c.name == "training" and hasattr(c, "ingest"):
                return c  # type: ignore[return-value]
        return None

    def state_extra(self) -> dict[str, Any]:
        last = self.reporter.last_report
        return {
            "node": self.config.node,
            "version": agent.__version__,
            "boot_id": self.boot_id,
            "nvml_backend": self.config.nvml.backend,
            "last_report": last.model_dump(mode="json", exclude_none=True) if last else None,
        }

    async def run(self, stop: asyncio.Event, on_ready: Callable[[str], None] | None = None) -> None:
        host, port = split_hostport(self.config.listen, "listen")
        app = make_app(snapshot=self.snapshot, render_metrics=self.render_metrics, state_extra=self.state_extra,
                       heartbeat_sink=self.heartbeat_sink(), clock=self.seams.clock)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
        udp = None
        sink = self.heartbeat_sink()
        training_cfg = getattr(self.config.collectors, "training", None)
        if sink is not None and training_cfg is not None:
            uhost, uport = split_hostport(training_cfg.udp_listen, "collectors.training.udp_listen")
            udp = await start_udp(sink, uhost, uport, self.seams.clock)
        bound = runner.addresses[0] if runner.addresses else (host, port)
        address = f"{bound[0]}:{bound[1]}"
        log.info("vigil agent %s on %s (node %s, backend %s, collectors: %s)", agent.__version__, address,
                 self.config.node, self.config.nvml.backend, ", ".join(c.name for c in self.collectors))
        if on_ready:
            on_ready(address)
        notifier = SdNotifier.from_environment()  # systemd Type=notify: no-op outside systemd
        notifier.ready(f"serving {address}")
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self.runner.run(stop))
                tg.create_task(self.reporter.run(stop))
                tg.create_task(watchdog_pings(notifier, stop))
        finally:
            notifier.stopping()
            if udp is not None:
                udp.close()
            await runner.cleanup()


async def watchdog_pings(notifier: SdNotifier, stop: asyncio.Event) -> None:
    """Pings systemd's watchdog from the event loop at half WatchdogSec: a wedged loop (which would
    also stop scrapes and reports) misses its pings and systemd restarts the agent."""
    interval = notifier.watchdog_interval_seconds
    while interval is not None and not stop.is_set():
        notifier.watchdog()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval)


def make_seams(config: AgentConfig, *, kmsg: str | None = None, sysfs_root: str | None = None,
               clock: Callable[[], float] = time.time) -> Seams:
    seams = Seams(clock=clock, state_dir=Path(config.state_dir) if config.state_dir else None)
    if kmsg is not None:
        seams = replace(seams, kmsg=kmsg)
    if sysfs_root is not None:
        seams = replace(seams, sysfs_root=Path(sysfs_root))
    return replace(seams, nvml=open_nvml(config, clock))

"""Assembles the agent from its configuration and runs it until told to stop.

It builds the real seams (NVML backend, sysfs root, kernel log, command runner, clock), the
collectors named in the registry, the runner, the reporter and the server, and owns the one
asyncio loop. It contains no collection logic.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from aiohttp import web
from prometheus_client import CollectorRegistry

from vigil.agent.attribution import ProcessIdentities
from vigil.agent.collectors import REGISTRY
from vigil.agent.collectors.collector import Collection, Collector
from vigil.agent.config import AgentConfig
from vigil.agent.credential_exposure import ExposedFiles
from vigil.agent.dcgm_compat import DcgmCompatCollector
from vigil.agent.exporter import SnapshotExporter, render
from vigil.agent.launcher_health import LauncherHealth
from vigil.agent.metric import Sample
from vigil.agent.node_action_runner import NODE_ACTION_SPECS, NodeActionRunner, ProbeWorld
from vigil.agent.probes.engine import build_engine
from vigil.agent.reporter import LAST_SUCCESS, REPORTER_SPECS, Reporter, client_ssl_context
from vigil.agent.runner import RUNNER_SPECS, Runner
from vigil.agent.sd_notify import SdNotifier
from vigil.agent.server import (
    IDLE_TIMEOUT_SECONDS,
    ConnectionLimit,
    HeartbeatIntake,
    HeartbeatSink,
    UnixHeartbeats,
    is_loopback_host,
    make_app,
    make_heartbeat_app,
    serve_bounded,
    split_hostport,
    start_udp,
    start_unix,
)
from vigil.agent.snapshot import Snapshot
from vigil.contract.build_info import register_build_info
from vigil.contract.credential_file import TokenFile
from vigil.contract.seams import Seams
from vigil.contract.version import __version__
from vigil.contract.wire import to_readable

log = logging.getLogger("vigil.agent")

_T = TypeVar("_T")


async def _bind(start: Awaitable[_T], address: str, key: str) -> _T:
    """``start`` (a socket bind); an OSError naming the address and the config key when it fails
    ("Address already in use" alone does not say which of a host's agents holds what)."""
    try:
        return await start
    except OSError as exc:
        raise OSError(exc.errno, f"cannot listen on {address} ({key}): {exc.strerror or exc}") from None

BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")


def reporter_state_dir(state_dir: Path | None, index: int) -> Path | None:
    """Where the reporter to the ``index``-th aggregator journals its backlog."""
    if state_dir is None or index == 0:
        return state_dir
    sub = state_dir / f"aggregator-{index + 1}"
    sub.mkdir(mode=0o700, exist_ok=True)
    return sub


def read_boot_id(path: Path = BOOT_ID_PATH) -> str:
    """The kernel's boot id plus a per-start suffix: counters restart when either changes."""
    try:
        kernel = path.read_text().strip().replace("-", "")[:16]
    except OSError:
        kernel = "unknown"
    return f"{kernel}-{secrets.token_hex(4)}"


def open_nvml(config: AgentConfig, clock: Callable[[], float]) -> Any:
    from vigil.agent.gpu_backend import open_gpu_backend  # pulls in pynvml or amdsmi only when needed

    return open_gpu_backend(config.nvml, clock)


def probe_world(config: AgentConfig, seams: Seams) -> ProbeWorld:
    """What run_probes reaches the world through. The compute engine (torch) is built only where
    node_actions.allow lists run_probes: an agent that never probes never imports torch."""
    engine = None
    if "run_probes" in config.node_actions.allow:
        engine = build_engine(seams.nvml)
        if engine is None:
            log.warning("run_probes is allowed but there is no compute engine (torch is not installed): the GPU "
                        "probes will be reported skipped (no_engine)")
    return ProbeWorld(config=config.probes, engine=engine, run=seams.run, sysfs_root=seams.sysfs_root)


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

    def __init__(self, config: AgentConfig, seams: Seams, *, boot_id_path: Path = BOOT_ID_PATH) -> None:
        """``boot_id_path``: the kernel's boot id (a drill or test points it at a file it rewrites
        to stand for a reboot)."""
        self.config = config
        self.seams = seams
        self.snapshot = Snapshot()
        self.collectors = build_collectors(config, seams)
        # Re-read whenever the file is replaced (a projected Kubernetes token rotates).
        token = TokenFile(config.aggregator.token_file) if config.aggregator.token_file else None
        self.credential_files = ExposedFiles({"aggregator.token_file": config.aggregator.token_file,
                                              "aggregator.key_file": config.aggregator.key_file,
                                              "node_actions.key_file": config.node_actions.key_file})
        self.boot_id = read_boot_id(boot_id_path)
        target = config.aggregator
        # What the aggregator may ask of this node (nothing unless node_actions.allow lists it).
        self.node_actions = NodeActionRunner(config.node_actions, node=config.node, boot_id=self.boot_id,
                                             nvml=seams.nvml, clock=seams.clock, probes=probe_world(config, seams))
        for url in target.targets:
            if token and url.startswith("http://"):
                log.warning("aggregator URL %s is plain http: this node's token crosses the network readable; "
                            "use https:// with aggregator.ca_file", url)
        # One reporter per aggregator (every replica of an HA pair gets every report), each with its
        # own sequence, backlog and journal: the first keeps state_dir itself, the others a
        # subdirectory each, so a replica that is down delays nothing sent to the other.
        self.reporters = [Reporter(
            url=url, token=token, node=config.node, boot_id=self.boot_id,
            topology=config.topology, snapshot=self.snapshot, interval_seconds=target.interval_seconds,
            timeout_seconds=target.timeout_seconds, max_backoff_seconds=target.max_backoff_seconds,
            max_report_bytes=target.max_report_bytes, max_pending_event_bytes=target.max_pending_event_bytes,
            ssl_context=client_ssl_context(url, target.ca_file, target.cert_file, target.key_file),
            state_dir=reporter_state_dir(seams.state_dir, i), clock=seams.clock, node_actions=self.node_actions.handle,
            telemetry_seconds=target.telemetry_seconds)
            for i, url in enumerate(target.targets or [None])]
        self.reporter = self.reporters[0]
        training = config.collectors.training
        self.heartbeats = HeartbeatIntake(
            self.heartbeat_sink(), seams.clock,
            identities=ProcessIdentities(Path(training.proc_root) if training.proc_root else seams.proc_root),
            accept_unverified=training.accept_unverified, unscheduled=training.unscheduled)
        self.connections = ConnectionLimit(config.listen_max_connections)
        intervals = {}
        for c in self.collectors:
            section = getattr(config.collectors, c.name)
            intervals[c.name] = (section.interval_seconds, section.timeout_seconds)
        self.runner = Runner(self.collectors, intervals, self.snapshot, self._on_events, clock=seams.clock)
        specs = [s for c in self.collectors for s in c.specs] + [*RUNNER_SPECS, *REPORTER_SPECS,
                                                                 *self.heartbeats.specs, *self.connections.specs,
                                                                 *NODE_ACTION_SPECS, *ExposedFiles.specs]
        sources = [self.snapshot.samples, self.runner.self_samples, self.reporter_samples, self.heartbeats.samples,
                   self.connections.samples, self.node_actions.samples, self.credential_files.samples]
        # ft_launcher's node health check, answered from the reporters' standing (off by default).
        self.launcher_health = LauncherHealth(config.launcher_health, self.reporters, seams.clock) \
            if config.launcher_health.enabled else None
        if self.launcher_health is not None:
            specs += self.launcher_health.specs
            sources.append(self.launcher_health.samples)
        self.exporter = SnapshotExporter(specs, sources)
        # Add-on prometheus-client collectors (e.g. dcgm-exporter compatibility) register here;
        # vigil's own series are rendered by the exporter's direct encoder.
        self.registry = CollectorRegistry(auto_describe=False)
        register_build_info(self.registry, "agent")
        if config.exporter.dcgm_compat:
            self.registry.register(DcgmCompatCollector(self.snapshot.samples, hostname=config.node))

    def reporter_samples(self) -> list[Sample]:
        """The reporters' series as one agent's: counters summed over the aggregators, the pending
        backlog summed, the last success the latest (an aggregator that stays unreachable shows
        as report errors here and as that aggregator's own silence there)."""
        if len(self.reporters) == 1:
            return self.reporter.samples()
        merged: dict[tuple[str, tuple[tuple[str, str], ...]], Sample] = {}
        for reporter in self.reporters:
            for sample in reporter.samples():
                key = (sample.name, sample.labels)
                seen = merged.get(key)
                if seen is None:
                    merged[key] = sample
                else:
                    value = max(seen.value, sample.value) if sample.name == LAST_SUCCESS.name \
                        else seen.value + sample.value
                    merged[key] = Sample(seen.name, value, seen.labels)
        return list(merged.values())

    def render_metrics(self) -> bytes:
        return render(self.exporter, self.registry)

    def _on_events(self, collection: Collection) -> None:
        for reporter in self.reporters:
            reporter.add_events(collection.events)

    def heartbeat_sink(self) -> HeartbeatSink | None:
        for c in self.collectors:
            if c.name == "training" and hasattr(c, "ingest"):
                return c  # type: ignore[return-value]
        return None

    def state_extra(self) -> dict[str, Any]:
        last = self.reporter.last_report
        return {
            "node": self.config.node,
            "version": __version__,
            "boot_id": self.boot_id,
            "nvml_backend": self.config.nvml.backend,
            "last_report": to_readable(last) if last else None,
        }

    async def run(self, stop: asyncio.Event, on_ready: Callable[[str], None] | None = None) -> None:
        host, port = split_hostport(self.config.listen, "listen")
        app = make_app(snapshot=self.snapshot, render_metrics=self.render_metrics, state_extra=self.state_extra,
                       intake=self.heartbeats)
        runner = web.AppRunner(app, access_log=None, keepalive_timeout=IDLE_TIMEOUT_SECONDS)
        await runner.setup()
        listeners = _Listeners()
        try:
            listeners.server = await _bind(serve_bounded(runner, host, port, self.connections), self.config.listen,
                                           "listen")
            await self._start_heartbeat_listeners(listeners)
            if self.launcher_health is not None:
                listeners.launcher_health = self.launcher_health
                await self.launcher_health.start()
            sockets = listeners.server.sockets
            bound = sockets[0].getsockname() if sockets else (host, port)
            address = f"{bound[0]}:{bound[1]}"
            log.info("vigil agent %s on %s (node %s, backend %s, collectors: %s)", __version__, address,
                     self.config.node, self.config.nvml.backend, ", ".join(c.name for c in self.collectors))
            if on_ready:
                on_ready(address)
            notifier = SdNotifier.from_environment()  # systemd Type=notify: no-op outside systemd
            notifier.ready(f"serving {address}")
            try:
                async with asyncio.TaskGroup() as tg:
                    tg.create_task(self.runner.run(stop))
                    for reporter in self.reporters:
                        tg.create_task(reporter.run(stop))
                    tg.create_task(watchdog_pings(notifier, stop))
            finally:
                notifier.stopping()
        finally:
            await listeners.close()
            await runner.cleanup()

    async def _start_heartbeat_listeners(self, listeners: _Listeners) -> None:
        """UDP and HTTP on collectors.training.udp_listen, and the Unix socket if configured: the
        node-local doors for heartbeats, apart from the /metrics listener."""
        cfg = self.config.collectors.training
        if self.heartbeats.sink is None:
            return
        host, port = split_hostport(cfg.udp_listen, "collectors.training.udp_listen")
        if not is_loopback_host(host):
            log.warning("collectors.training.udp_listen %s is not a loopback address: heartbeats from other "
                        "hosts are refused and counted (not_local); pods reach the agent through "
                        "collectors.training.unix_socket", cfg.udp_listen)
        if not cfg.unix_socket:
            log.warning("collectors.training.unix_socket is not set: heartbeats can only come over UDP/HTTP, "
                        "which carry no sender identity (%s)",
                        "accepted as unverified" if cfg.accept_unverified
                        else "refused: collectors.training.accept_unverified is off")
        listeners.datagrams.append(await _bind(start_udp(self.heartbeats, host, port), cfg.udp_listen,
                                              "collectors.training.udp_listen"))
        if cfg.http:
            listeners.http = web.AppRunner(make_heartbeat_app(self.heartbeats), access_log=None)
            await listeners.http.setup()
            await _bind(web.TCPSite(listeners.http, host, port).start(), cfg.udp_listen,
                        "collectors.training.udp_listen (http)")
        if cfg.unix_socket:
            listeners.unix = await _bind(start_unix(self.heartbeats, cfg.unix_socket, cfg.unix_socket_mode,
                                                    cfg.unix_socket_group),
                                         cfg.unix_socket, "collectors.training.unix_socket")
            listeners.unix_socket = (cfg.unix_socket, os.stat(cfg.unix_socket).st_ino)
        log.info("heartbeats on %s%s (UDP%s, %s)", f"unix:{cfg.unix_socket} and " if cfg.unix_socket else "",
                 cfg.udp_listen, ", HTTP" if cfg.http else "",
                 "unverified, accepted" if cfg.accept_unverified else "unverified, refused")


class _Listeners:
    """What ``Agent.run`` opened, closed in one place whether start-up finished or not."""

    def __init__(self) -> None:
        self.server: asyncio.Server | None = None
        self.http: web.AppRunner | None = None
        self.datagrams: list[asyncio.DatagramTransport] = []
        self.unix: UnixHeartbeats | None = None
        self.unix_socket: tuple[str, int] | None = None  # (path, inode): remove ours, never a successor's
        self.launcher_health: LauncherHealth | None = None

    async def close(self) -> None:
        if self.launcher_health is not None:
            await self.launcher_health.stop()
        for transport in self.datagrams:
            transport.close()
        if self.unix is not None:
            self.unix.close()
        if self.unix_socket is not None:
            path, inode = self.unix_socket
            with contextlib.suppress(OSError):
                if os.stat(path).st_ino == inode:
                    os.unlink(path)
        if self.http is not None:
            await self.http.cleanup()
        if self.server is not None:
            self.server.close()


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

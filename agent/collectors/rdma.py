"""RDMA collector: InfiniBand and RoCE ports read from ``<sysfs>/class/infiniband``.

Reads each port's state, physical state, rate, link layer and every counter in ``counters/``,
``hw_counters/`` and ``counters_ext/`` (a 64-bit twin there wins over its ``counters/`` file); for
RoCE ports also the netdev's ``carrier_changes`` and the per-priority PFC pause counters of
``ethtool -S``. Emits them as samples, a ``PortState`` per port (raw counters, deltas of those
that moved, reset/saturation flags) and link events. It does not judge error rates (the aggregator
does) and never turns a counter that went backwards or sits at its saturation value into a delta.
"""

from __future__ import annotations

import errno
import logging
import os
import subprocess
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import Field

from vigil.agent.collectors.collector import Collection, CollectorConfig
from vigil.agent.collectors.rdma_counters import (
    CARRIER_CHANGES,
    COUNTER_RESETS,
    COUNTER_SATURATED,
    COUNTERS,
    DEVICE_INFO,
    DRIVER_COUNTER,
    EXT_COUNTERS,
    NOT_COUNTERS,
    PAUSE_DURATION_UNIT_SECONDS,
    PFC_PAUSE_DURATION,
    PFC_PAUSE_FRAMES,
    PFC_RE,
    PHYS_STATE_LINK_UP,
    PORT_INFO,
    PORT_PHYSICAL_STATE,
    PORT_RATE,
    PORT_STATE,
    READ_ERRORS,
    SPECS,
    STATE_ACTIVE,
    parse_ethtool_stats,
    parse_rate_bits_per_second,
    parse_state,
)
from vigil.agent.metric import MetricSpec, Sample
from vigil.contract.seams import CommandRunner, run_command
from vigil.contract.wire import Event, PortState

if TYPE_CHECKING:
    from vigil.agent.config import AgentConfig
    from vigil.contract.seams import Seams

log = logging.getLogger("vigil.agent.collectors.rdma")


class RdmaConfig(CollectorConfig):
    # Every 2 s: on real HCAs each counters/ read is a firmware (MAD) query, and the judgements
    # built on these counters are rates and flap counts over tens of seconds; a port going down
    # is still seen within 2 s (node_exporter's usual scrape is 15 s).
    interval_seconds: float = Field(default=2.0, gt=0)
    # Devices, ports and counter files rarely change (driver reload, hot plug); listing them every
    # cycle would cost more than reading them. A vanished file or a new device forces a rescan.
    rescan_interval_seconds: float = Field(default=60.0, gt=0)
    # PFC counters come from a subprocess per RoCE netdev: too costly for every 1 s cycle.
    ethtool: bool = True
    ethtool_interval_seconds: float = Field(default=10.0, gt=0)
    ethtool_timeout_seconds: float = Field(default=2.0, gt=0)
    # Keep each per-cycle sysfs attribute open and re-read it at offset 0: about 7x cheaper than
    # opening ~50 files per port every cycle, at the cost of ~55 descriptors per port.
    keep_files_open: bool = True


class _Unusable(Exception):
    """A file whose content cannot be used; ``reason`` is the read-errors label."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason




class AttributeFiles:
    """How the collector opens the attributes it keeps open and closes them again: a descriptor
    of its own per file, as an agent does. The simulator's nodes on one shared read-only tree
    share one descriptor per file instead (sim/fabric.py ``SharedAttributeFiles``): pread at
    offset 0 moves no file position, so readers of one descriptor cannot disturb each other."""

    def open(self, path: str) -> int:
        """A read-only descriptor of ``path``; OSError (FileNotFoundError, EMFILE) as os.open."""
        return os.open(path, os.O_RDONLY)

    def close(self, fd: int) -> None:
        os.close(fd)


class _File:
    """One sysfs attribute read every cycle. Kept open and re-read with pread at offset 0, which
    makes sysfs call the attribute's show() again (kernel Documentation/filesystems/sysfs.rst):
    an open+close per file per cycle would cost more than the read itself."""

    __slots__ = ("fd", "path")

    def __init__(self, path: str, fd: int | None) -> None:
        self.path = path
        self.fd = fd


@dataclass(slots=True)
class _CounterFile:
    name: str
    file: _File
    metric: str
    labels: tuple[tuple[str, str], ...]  # the sample's labels
    scale: int
    max_raw: int | None  # saturation value of a fixed-width IBTA counter
    saturated_labels: tuple[tuple[str, str], ...] | None
    # Most error counters sit still: their samples are built once and reused while the raw value holds.
    last_raw: int | None = None
    sample: Sample | None = None
    saturated_sample: Sample | None = None


@dataclass(slots=True)
class _Port:
    """What a rescan learned about one port; valid until the next rescan."""

    device: str
    port: int
    labels: tuple[tuple[str, str], ...]
    state: _File | None
    phys_state: _File | None
    rate: _File | None
    counters: list[_CounterFile]  # counters/, hw_counters/, then the netdev's carrier_changes
    link_layer: str | None
    netdev: str | None

    def files(self) -> list[_File]:
        return [f for f in (self.state, self.phys_state, self.rate) if f is not None] + [
            c.file for c in self.counters]


@dataclass(slots=True)
class _History:
    """What the previous cycles saw on one port; survives rescans."""

    readings: dict[str, int] = field(default_factory=dict)  # counter name -> raw value last read
    state: tuple[int, str] | None = None
    phys_state: tuple[int, str] | None = None
    resets: int = 0
    # Last successful ethtool reading of the netdev.
    ethtool: dict[str, int] | None = None
    # When ethtool was last run, successfully or not: a failing ethtool is retried on the same
    # cadence, not every cycle.
    ethtool_tried_at: float | None = None


class RdmaCollector:
    name = "rdma"
    specs: Sequence[MetricSpec] = SPECS

    def __init__(self, config: RdmaConfig, sysfs_root: Path = Path("/sys"), run: CommandRunner = run_command,
                 files: AttributeFiles | None = None) -> None:
        self._config = config
        self._files = files if files is not None else AttributeFiles()
        self._root = Path(sysfs_root)
        self._ib_dir = str(self._root / "class" / "infiniband")
        self._run = run
        self._ports: list[_Port] = []
        self._device_info: dict[str, tuple[str, str, str]] = {}
        self._devices_seen: list[str] = []
        self._scanned_at: float | None = None
        self._rescan = True
        self._history: dict[tuple[str, int], _History] = {}
        self._errors: Counter[tuple[str, str]] = Counter()
        self._fd_limit_logged = False

    # -- reading -------------------------------------------------------------------------------

    def _read(self, path: str) -> str:
        """Open, read and close; FileNotFoundError propagates, other OS errors become _Unusable."""
        return self._read_file(_File(path, None))

    def _read_file(self, f: _File) -> str:
        """The attribute's text; FileNotFoundError when it is gone, _Unusable when it cannot be used."""
        try:
            if f.fd is not None:
                data = os.pread(f.fd, 4096, 0)
            else:
                fd = os.open(f.path, os.O_RDONLY)
                try:
                    data = os.read(fd, 4096)
                finally:
                    os.close(fd)
        except FileNotFoundError:
            raise
        except OSError as exc:
            # A kept-open sysfs attribute answers ENODEV once its device went away (driver reload).
            if exc.errno in (errno.ENOENT, errno.ENODEV):
                raise FileNotFoundError(f.path) from None
            raise _Unusable("unreadable") from None
        text = data.decode("ascii", "replace").strip()
        if not text:
            raise _Unusable("empty")
        return text

    def _read_optional(self, path: str) -> str | None:
        try:
            return self._read(path)
        except (FileNotFoundError, _Unusable):
            return None

    def _open(self, path: str) -> _File | None:
        """The attribute to read every cycle, or None when it does not exist."""
        if not self._config.keep_files_open:
            return _File(path, None) if os.path.exists(path) else None
        try:
            return _File(path, self._files.open(path))
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE) and not self._fd_limit_logged:
                self._fd_limit_logged = True
                log.warning("file descriptor limit reached; reading remaining RDMA counters by path")
            return _File(path, None)  # read by path each cycle; a persistent failure is counted there

    def _count(self, device: str, reason: str) -> None:
        self._errors[(device, reason)] += 1

    # -- discovery -----------------------------------------------------------------------------

    def _scan(self, devices: list[str]) -> None:
        self._close_files()
        ports: list[_Port] = []
        info: dict[str, tuple[str, str, str]] = {}
        for device in devices:
            # Paths joined with "/" (sysfs names carry no separator): posixpath.join per file is
            # a large share of a rescan, which reopens every counter (~370 files on 8 HCAs).
            dev_dir = f"{self._ib_dir}/{device}"
            hca_type, fw_ver, board_id = (self._read_optional(f"{dev_dir}/{f}") or ""
                                          for f in ("hca_type", "fw_ver", "board_id"))
            info[device] = (hca_type, fw_ver, board_id)
            try:
                port_names = os.listdir(f"{dev_dir}/ports")
            except FileNotFoundError:
                continue
            except OSError:
                self._count(device, "unreadable")
                continue
            for port_name in sorted(port_names, key=lambda p: (len(p), p)):
                if not port_name.isdigit():
                    continue
                ports.append(self._scan_port(device, dev_dir, int(port_name)))
        self._ports = ports
        self._device_info = info
        self._devices_seen = devices

    def _scan_port(self, device: str, dev_dir: str, port: int) -> _Port:
        path = f"{dev_dir}/ports/{port}"
        labels = (("device", device), ("port", str(port)))
        counters: list[_CounterFile] = []
        ext = self._list_counters(device, f"{path}/counters_ext")
        superseded = {EXT_COUNTERS[name] for name in ext if name in EXT_COUNTERS}
        for sub in ("counters", "hw_counters", "counters_ext"):
            sub_dir = f"{path}/{sub}"
            names = ext if sub == "counters_ext" else self._list_counters(device, sub_dir)
            for name in names:
                if name in NOT_COUNTERS or (sub == "counters" and name in superseded):
                    continue
                f = self._open(f"{sub_dir}/{name}")
                if f is not None:
                    counters.append(self._counter_file(EXT_COUNTERS.get(name, name) if sub == "counters_ext"
                                                       else name, f, labels))
        link_layer = self._read_optional(f"{path}/link_layer")
        netdev = self._find_netdev(dev_dir, path) if link_layer == "Ethernet" else None
        if netdev is not None:
            carrier = self._open(str(self._root / "class" / "net" / netdev / "carrier_changes"))
            if carrier is not None:
                counters.append(_CounterFile("carrier_changes", carrier, CARRIER_CHANGES.name, labels, 1, None,
                                             None))
        return _Port(device, port, labels, self._open(f"{path}/state"),
                     self._open(f"{path}/phys_state"), self._open(f"{path}/rate"),
                     counters, link_layer, netdev)

    def _list_counters(self, device: str, sub_dir: str) -> list[str]:
        try:
            return sorted(os.listdir(sub_dir))
        except FileNotFoundError:
            return []  # irdma has no counters/, older drivers no hw_counters/: absent, not zero
        except OSError:
            self._count(device, "unreadable")
            return []

    @staticmethod
    def _counter_file(name: str, f: _File, labels: tuple[tuple[str, str], ...]) -> _CounterFile:
        d = COUNTERS.get(name)
        if d is None:
            return _CounterFile(name, f, DRIVER_COUNTER.name, (*labels, ("counter", name)), 1, None, None)
        max_raw = (1 << d.width_bits) - 1 if d.width_bits is not None else None
        return _CounterFile(name, f, d.spec.name, labels, d.scale, max_raw,
                            (*labels, ("counter", name)) if max_raw is not None else None)

    def _find_netdev(self, dev_dir: str, port_dir: str) -> str | None:
        # The RoCE GID table names the netdev carrying the port (for a LAG, the bond); fall back to
        # the PCI function's only netdev.
        name = self._read_optional(os.path.join(port_dir, "gid_attrs", "ndevs", "0"))
        if name:
            return name
        try:
            nets = os.listdir(os.path.join(dev_dir, "device", "net"))
        except OSError:
            return None
        return nets[0] if len(nets) == 1 else None

    def _close_files(self) -> None:
        for port in self._ports:
            for f in port.files():
                if f.fd is not None:
                    self._files.close(f.fd)
                    f.fd = None

    # -- one cycle -----------------------------------------------------------------------------

    def collect(self, now: float) -> Collection:
        try:
            devices = sorted(os.listdir(self._ib_dir))
        except FileNotFoundError:
            devices = []  # no RDMA hardware (or no driver): no ports, not a failure
        except OSError:
            self._count("", "unreadable")
            devices = []
        due = self._scanned_at is None or now - self._scanned_at >= self._config.rescan_interval_seconds
        if self._rescan or due or devices != self._devices_seen:
            self._scan(devices)
            self._scanned_at = now
            self._rescan = False

        out = Collection()
        for device, (hca_type, fw_ver, board_id) in self._device_info.items():
            out.samples.append(Sample.of(DEVICE_INFO, 1, device=device, hca_type=hca_type, fw_ver=fw_ver,
                                         board_id=board_id))
        present: set[tuple[str, int]] = set()
        ports: list[PortState] = []
        for port in self._ports:
            key = (port.device, port.port)
            present.add(key)
            history = self._history.get(key)
            first = history is None
            if history is None:
                history = self._history[key] = _History()
            ports.append(self._collect_port(port, history, first, now, out))
        for key in [k for k in self._history if k not in present]:
            del self._history[key]
            out.events.append(Event(kind="link_down", ts=now, urgent=True, source="sysfs", device=key[0],
                                    port=key[1], message=f"{key[0]} port {key[1]} is no longer present in sysfs"))
        for (device, reason), n in sorted(self._errors.items()):
            out.samples.append(Sample.of(READ_ERRORS, n, device=device, reason=reason))
        out.report = {"ports": ports}
        return out

    def _collect_port(self, port: _Port, history: _History, first: bool, now: float, out: Collection) -> PortState:
        labels = port.labels
        samples = out.samples
        state = self._read_state(port, port.state)
        phys = self._read_state(port, port.phys_state)
        rate = self._read_rate(port)
        if state is not None:
            samples.append(Sample(PORT_STATE.name, float(state[0]), (*labels, ("state", state[1]))))
        if phys is not None:
            samples.append(Sample(PORT_PHYSICAL_STATE.name, float(phys[0]), (*labels, ("physical_state", phys[1]))))
        if rate is not None:
            samples.append(Sample(PORT_RATE.name, rate / 8, labels))
        samples.append(Sample(PORT_INFO.name, 1.0, (*labels, ("link_layer", port.link_layer or ""),
                                                    ("netdev", port.netdev or ""))))

        counters: dict[str, int] = {}
        deltas: dict[str, int] = {}
        flags: dict[str, str] = {}
        moved: set[str] = set()
        reset: list[str] = []
        readings = history.readings

        def account(name: str, raw: int, scale: int, max_raw: int | None) -> None:
            saturated = max_raw is not None and raw >= max_raw
            prev_raw = readings.get(name)
            readings[name] = raw
            if prev_raw is None:
                if saturated:
                    flags[name] = "saturated"
                return
            if raw < prev_raw:
                flags[name] = "reset"
                reset.append(name)
                return
            if raw > prev_raw:
                moved.add(name)
            if saturated:
                flags[name] = "saturated"
                return
            if raw == prev_raw:
                return  # the report carries deltas of counters that moved, not 45 zeros
            deltas[name] = (raw - prev_raw) * scale

        pread = os.pread
        for c in port.counters:
            # Fast path: a kept-open file holding digits. Anything else (no descriptor, an error,
            # "N/A", garbage) goes through _read_counter, which classifies and counts it.
            raw: int | None = None
            fd = c.file.fd
            if fd is not None:
                try:
                    text = pread(fd, 64, 0).strip()
                except OSError:
                    text = b""
                if text.isdigit():
                    raw = int(text)
            if raw is None:
                raw = self._read_counter(port, c.file)
                if raw is None:
                    continue
            if raw != c.last_raw or c.sample is None:
                c.last_raw = raw
                c.sample = Sample(c.metric, float(raw * c.scale), c.labels)
                if c.saturated_labels is not None and c.max_raw is not None:
                    c.saturated_sample = Sample(COUNTER_SATURATED.name, 1.0 if raw >= c.max_raw else 0.0,
                                                c.saturated_labels)
            samples.append(c.sample)
            if c.saturated_sample is not None:
                samples.append(c.saturated_sample)
            name = c.name
            counters[name] = raw * c.scale
            if readings.get(name) != raw or (c.max_raw is not None and raw >= c.max_raw):
                account(name, raw, c.scale, c.max_raw)  # a counter that did not move needs nothing

        pfc, pfc_fresh = self._pfc(port, history, now)
        for name, raw in pfc.items():
            m = PFC_RE.match(name)
            assert m is not None  # _pfc only keeps names that match
            direction, priority, duration = m.group(1), m.group(2), m.group(3)
            counters[name] = raw
            pfc_labels = (*labels, ("priority", priority), ("direction", direction))
            if duration:
                samples.append(Sample(PFC_PAUSE_DURATION.name, raw * PAUSE_DURATION_UNIT_SECONDS, pfc_labels))
            else:
                samples.append(Sample(PFC_PAUSE_FRAMES.name, float(raw), pfc_labels))
            if pfc_fresh:
                account(name, raw, 1, None)  # deltas between two ethtool readings only

        history.resets += len(reset)
        samples.append(Sample(COUNTER_RESETS.name, float(history.resets), labels))
        if reset:
            out.events.append(Event(kind="counter_reset", ts=now, source="sysfs", device=port.device,
                                    port=port.port, count=len(reset),
                                    message=f"{port.device} port {port.port}: counters went backwards: "
                                            + ", ".join(sorted(reset))))
        if not first:
            event = self._link_event(port, history, state, phys, moved, now)
            if event is not None:
                out.events.append(event)
        if state is not None:
            history.state = state
        if phys is not None:
            history.phys_state = phys
        return PortState(device=port.device, port=port.port, state=state[1] if state else None,
                         phys_state=phys[1] if phys else None, rate_bits_per_second=rate,
                         link_layer=port.link_layer, netdev=port.netdev, counters=counters, deltas=deltas,
                         flags=flags)

    def _link_event(self, port: _Port, history: _History, state: tuple[int, str] | None,
                    phys: tuple[int, str] | None, moved: set[str], now: float) -> Event | None:
        if history.state is None or history.phys_state is None or state is None or phys is None:
            return None  # one side unknown: no edge can be claimed
        was_up = history.state[0] == STATE_ACTIVE and history.phys_state[0] == PHYS_STATE_LINK_UP
        is_up = state[0] == STATE_ACTIVE and phys[0] == PHYS_STATE_LINK_UP
        change = f"{history.state[1]}/{history.phys_state[1]} -> {state[1]}/{phys[1]}"
        where = f"{port.device} port {port.port}"
        if was_up and not is_up:
            return Event(kind="link_down", ts=now, urgent=True, source="sysfs", device=port.device,
                         port=port.port, message=f"{where} went down: {change}")
        if is_up and not was_up:
            return Event(kind="link_up", ts=now, source="sysfs", device=port.device, port=port.port,
                         message=f"{where} came up: {change}")
        # Up before and now, yet the link went down in between: link_downed (IB) or the netdev's
        # carrier_changes (RoCE) moved.
        bounced = sorted(moved & {"link_downed", "carrier_changes"})
        if is_up and bounced:
            return Event(kind="link_flap", ts=now, source="sysfs", device=port.device, port=port.port,
                         message=f"{where} flapped between two readings ({', '.join(bounced)} moved)")
        return None

    def _read_state(self, port: _Port, f: _File | None) -> tuple[int, str] | None:
        if f is None:
            return None
        try:
            return parse_state(self._read_file(f))
        except FileNotFoundError:
            self._rescan = True
        except _Unusable as exc:
            self._count(port.device, exc.reason)
        except ValueError:
            self._count(port.device, "malformed")
        return None

    def _read_rate(self, port: _Port) -> float | None:
        if port.rate is None:
            return None  # some drivers have no rate file: absent
        try:
            return parse_rate_bits_per_second(self._read_file(port.rate))
        except FileNotFoundError:
            self._rescan = True
        except _Unusable as exc:
            self._count(port.device, exc.reason)
        except ValueError:
            self._count(port.device, "malformed")
        return None

    def _read_counter(self, port: _Port, f: _File) -> int | None:
        try:
            text = self._read_file(f)
        except FileNotFoundError:
            self._rescan = True  # the counter set changed (driver reload): relist next cycle
            return None
        except _Unusable as exc:
            self._count(port.device, exc.reason)
            return None
        if text.isdigit():
            return int(text)
        if text.startswith("N/A"):
            return None  # the kernel's "N/A (no PMA)": the hardware does not report it
        self._count(port.device, "malformed")
        return None

    def _pfc(self, port: _Port, history: _History, now: float) -> tuple[dict[str, int], bool]:
        """This port's PFC counters (fresh or the last good reading) and whether they are fresh."""
        if not self._config.ethtool or port.netdev is None:
            return {}, False
        tried = history.ethtool_tried_at
        if tried is not None and now - tried < self._config.ethtool_interval_seconds:
            return history.ethtool or {}, False
        history.ethtool_tried_at = now
        try:
            text = self._run(["ethtool", "-S", port.netdev], self._config.ethtool_timeout_seconds)
            stats = parse_ethtool_stats(text)
        except (OSError, subprocess.SubprocessError) as exc:
            self._count(port.device, "ethtool_failed")
            log.warning("ethtool -S %s failed: %s", port.netdev, exc)
            history.ethtool = None  # stale PFC values would claim a port is quiet when we cannot tell
            return {}, False
        except ValueError as exc:
            self._count(port.device, "ethtool_malformed")
            log.warning("ethtool -S %s: %s", port.netdev, exc)
            history.ethtool = None
            return {}, False
        history.ethtool = {k: v for k, v in stats.items() if PFC_RE.match(k) and v >= 0}
        return history.ethtool, True

    def close(self) -> None:
        self._close_files()
        self._ports = []
        self._devices_seen = []
        self._rescan = True


# This collector's section under `collectors:` (agent.collectors.COLLECTORS derives it).
CONFIG = RdmaConfig


def build(config: AgentConfig, seams: Seams) -> RdmaCollector:
    # The simulator's shared read-only tree passes its shared descriptors (``rdma_files``).
    return RdmaCollector(config.collectors.section("rdma", RdmaConfig), sysfs_root=seams.sysfs_root, run=seams.run,
                         files=seams.extra.get("rdma_files"))

"""Network detector: RDMA ports that are down, flapping, erroring or trained below their rate.

It reads each port's state, rate and counters (deltas between reports of one boot), keeping its own
bounded memory of each port's ``link_downed`` increases. A port down, a flapping link, a bit-error rate
above the IBTA ratio or a link retrained below its earlier rate drains the node, while congestion
counters (ECN, CNP, PFC) describe the fabric and only observe; drops shared by several nodes at once
are the fabric's, and a shared switch is the topology pass's. The five flap horizons, thresholds and
designed false-alert and false-drain rates: docs/detectors.md, "network".
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import Counter, deque

from pydantic import Field, model_validator

from vigil.aggregator.decision import Action, Finding
from vigil.aggregator.detectors.quiet_nodes import ChangedNodes
from vigil.aggregator.fleet import FleetView, NodeState, PortHistory, port_is_active
from vigil.contract.validation import StrictModel
from vigil.contract.wire import PORT_TRAFFIC_COUNTERS

NAME = "network"


class NetworkConfig(StrictModel):
    enabled: bool = True
    # A port down longer than this is down; shorter is a flap (counted below).
    down_seconds: float = Field(default=10.0, ge=0)
    down_action: Action = Action.DRAIN
    window_seconds: float = Field(default=600.0, gt=0)
    # link_downed + link_error_recovery events per window: three retrains in ten minutes is a bad
    # cable or transceiver (Azure HPC health checks fail a node on repeated "lost carrier" flaps).
    flap_counters: list[str] = Field(default_factory=lambda: ["link_downed", "link_error_recovery"])
    flap_threshold: int = Field(default=3, ge=1)
    flap_action: Action = Action.DRAIN
    # Slow flaps: a marginal transceiver or cable drops its link every few minutes to every few
    # hours and looks healthy in between, so no 10-minute window holds three drops. link_downed is
    # cumulative in the HCA (IBTA PortCounters LinkDownedCounter), so its increases over hours are
    # exact evidence. A healthy link keeps it at 0 between maintenance, and one maintenance costs a
    # port one or two drops (a leaf switch reboot or firmware activation, a reseated cable): 5
    # drops in 6 hours is a bad link with a margin of 3 over any maintenance. It catches a port
    # dropping every 6 minutes at its fifth drop (24 minutes), and any port dropping more often
    # than every 90 minutes (4 gaps inside 6 hours).
    # Counted: the link going down only (link_error_recovery is a retrain that kept the link up).
    flap_slow_counters: list[str] = Field(default_factory=lambda: ["link_downed"])
    flap_slow_window_seconds: float = Field(default=6 * 3600.0, gt=0)
    flap_slow_threshold: int = Field(default=5, ge=2)
    flap_slow_action: Action = Action.DRAIN
    # A drop that ports of at least this many nodes (this one included) took within
    # flap_shared_seconds of each other is the fabric's (a switch reboot): it never counts toward a
    # node's slow flaps. 3 nodes, as the topology pass's min_nodes: two bad cables are two bad
    # cables. An increase is known to within one report interval, so the nodes' own report
    # intervals widen the tolerance when they are longer; 10 s is four reports at the agent's
    # 2.5 s default, and two unrelated ports dropping every 6 minutes share a drop by chance
    # with probability ~(20 s / 360 s)^2 = 0.3% per drop.
    flap_shared_min_nodes: int = Field(default=3, ge=2)
    flap_shared_seconds: float = Field(default=10.0, ge=0)
    # Rare flaps, over a day: a link that drops once an hour never fills the 6-hour window
    # before its fifth drop (4 h after its first). flap_daily_threshold times the link went down
    # (flap_slow_counters, the node's own drops: shared ones excluded as above) within
    # flap_daily_window_seconds alerts: a person looks at the cable, nothing is removed. Healthy
    # IB links do not go down between maintenance: NVIDIA's Health Validation fails a GB200 node
    # on one RDMA link outage (rdma_linkflap_fatal, fatal_flap_threshold 1) and Meta's GCM health
    # checks call any InfiniBand "lost carrier" critical; one maintenance costs a port one or two
    # drops (a reseated cable), so three of its own in a day is one more than any maintenance.
    # Designed false-alert rate: at even 4 independent own drops a year per port, a third within
    # a day of two others happens 4 x (4/365)^2 / 2 = 2.4e-4 times a port-year (~2 alerts a year
    # on 10,000 ports). The once-an-hour link is alerted at its third drop (2 h after its first).
    flap_daily_threshold: int = Field(default=3, ge=2)
    flap_daily_window_seconds: float = Field(default=24 * 3600.0, gt=0)
    flap_daily_action: Action = Action.ALERT
    # Long horizons: flap_threshold events within this much time alerts ...
    flap_alert_window_seconds: float = Field(default=3600.0, gt=0)
    flap_alert_action: Action = Action.ALERT
    # ... and in each of flap_persist_hours of the last flap_persist_horizon_hours hours, drains.
    flap_persist_hours: int = Field(default=3, ge=1)
    flap_persist_horizon_hours: int = Field(default=4, ge=1)
    # IBTA specification vol. 2 (physical layer) requires a bit error ratio of at most 1e-12.
    error_counters: list[str] = Field(default_factory=lambda: ["symbol_error", "local_link_integrity_errors"])
    max_bit_error_ratio: float = Field(default=1e-12, gt=0)
    min_errors: int = Field(default=10, ge=1)
    error_action: Action = Action.DRAIN
    # A link that trained at 400 Gb/s in this boot and now runs at 200 Gb/s lost lanes or speed.
    rate_tolerance_ratio: float = Field(default=0.01, ge=0, lt=1)
    expected_rate_bits_per_second: float | None = Field(default=None, gt=0)
    degraded_seconds: float = Field(default=30.0, ge=0)
    degraded_action: Action = Action.DRAIN
    # Congestion counters inform only. The rate is a site's choice (no standard figure exists).
    # PFC pause frames per priority as ethtool -S names them on mlx5 (rx_prio3_pause, ...).
    congestion_counters: list[str] = Field(default_factory=lambda: [
        "np_ecn_marked_roce_packets", "np_cnp_sent", "rp_cnp_handled",
        *(f"{d}_prio{p}_pause" for d in ("rx", "tx") for p in range(8))])
    congestion_per_second: float = Field(default=10_000.0, gt=0)

    @model_validator(mode="after")
    def _slow_counters_are_tracked(self) -> NetworkConfig:
        # The fleet keeps only the counters some rule judges (flap_counters among them).
        extra = sorted(set(self.flap_slow_counters) - set(self.flap_counters))
        if extra:
            raise ValueError(f"flap_slow_counters must be among flap_counters; not: {extra}")
        # Traffic counters reach the aggregator at telemetry resolution only (wire.py): judged,
        # they would read as bursts every report_telemetry_seconds and silence in between.
        traffic = sorted(PORT_TRAFFIC_COUNTERS.intersection(
            [*self.flap_counters, *self.error_counters, *self.congestion_counters]))
        if traffic:
            raise ValueError(f"{traffic} count traffic, not faults: agents send them at telemetry resolution "
                             "(agent aggregator.telemetry_seconds), so no rule may judge them")
        return self


# Drops remembered per port and counter: far above any threshold (a port dropping this often
# within a day is drained on the short horizon long before).
_DROPS_KEPT = 64
PortKey = tuple[str, str, str]  # (node, port, counter)


class NetworkDetector:
    name = NAME

    def __init__(self, config: NetworkConfig) -> None:
        self.config = config
        # Link drops (flap_slow_counters increases) per port within the longest drop window,
        # derived from the view: the fleet keeps history_reports increases per counter, which a
        # site may set below a day's drops. Bounded: _DROPS_KEPT per port and counter, forgotten
        # when older than the window or when the port's node has left the view.
        self._drops: dict[PortKey, deque[tuple[float, float]]] = {}
        # The nodes to walk (docs/detectors.md, "change markers"): those whose ports' link state,
        # rate or flags changed (ports_revision) or whose port counters moved since the last pass,
        # and those with a port flagged when last walked (a counter moved within the longest
        # horizon, a link down, a rate below its expected one). And the nodes whose new link drops
        # are taken into the memory: those whose counters moved since, or within the drop window.
        self._walk = ChangedNodes("ports", "port_counters")
        self._drop_walk = ChangedNodes("port_counters")

    @property
    def drops_remembered(self) -> int:
        """Link drops held in the memory (its bound is tested)."""
        return sum(len(d) for d in self._drops.values())

    def evaluate(self, view: FleetView, now: float) -> list[Finding]:
        out: list[Finding] = []
        # A node none of whose ports had anything to judge when last walked is not visited until
        # a port's link changes or a counter moves (the journals); a view without them is walked whole.
        self._remember_drops(view, now)
        shared = self._shared_drops(view, now)
        cfg = self.config
        # A port whose counters did not move over the longest horizon, that is not down after
        # being up in this boot and not below its expected rate has no finding (``_judge``'s
        # tests, first the cheapest: most ports of the fleet).
        moved_after = now - self._flap_horizon()
        expected_rate, tolerance = cfg.expected_rate_bits_per_second, 1 - cfg.rate_tolerance_ratio
        walk = self._walk
        for node in walk.start(view, now):
            flagged = False
            for port in node.ports.values():
                if port.counters.last_increase_ts < moved_after:
                    rate = port.last.rate_bits_per_second
                    expected = expected_rate or port.max_rate_bits_per_second
                    if (not rate or not expected or rate >= expected * tolerance) and (
                            not port.active_this_boot or port_is_active(port.last)):
                        continue
                flagged = True
                if port.last_seen < node.last_seen:
                    continue
                out.extend(self._judge(node, port, now, shared))
            if flagged:
                walk.again(node)
        return out

    def _drop_window(self) -> float:
        return max(self.config.flap_slow_window_seconds, self.config.flap_daily_window_seconds)

    def _remember_drops(self, view: FleetView, now: float) -> None:
        """Take the ports' new link drops into the memory; forget what is older than the window.
        A node none of whose port counters moved after the window's start is not visited (with
        the journals: walked when a counter moves, and each pass while one moved within it)."""
        t0 = now - self._drop_window()
        for key in [k for k, drops in self._drops.items() if drops[-1][0] <= t0 or k[0] not in view.nodes]:
            del self._drops[key]
        walk, marked = self._drop_walk, view.journals is not None
        for node in walk.start(view, now):
            if marked and node.port_counters_moved_ts <= t0:
                continue
            walk.again(node)
            for port in node.ports.values():
                if port.counters.last_increase_ts <= t0:
                    continue
                for counter in self.config.flap_slow_counters:
                    key = (node.name, port.name, counter)
                    known = self._drops.get(key)
                    since = max(t0, known[-1][0]) if known else t0
                    new = [(ts, d) for ts, d in port.counters.increases_since(counter, since) if ts > since]
                    if not new:
                        continue
                    if known is None:
                        known = self._drops[key] = deque(maxlen=_DROPS_KEPT)
                    known.extend(new)

    def _port_drops(self, node: str, port: str, t0: float) -> list[tuple[float, float]]:
        """The port's remembered drops after ``t0``, oldest first."""
        return sorted(e for c in self.config.flap_slow_counters for e in self._drops.get((node, port, c), ())
                      if e[0] > t0)

    def _shared_drops(self, view: FleetView, now: float) -> frozenset[tuple[str, str, float]]:
        """(node, port, ts) of the remembered link drops that ports of at least
        ``flap_shared_min_nodes`` nodes took at the same moment: the fabric's, not a node's."""
        cfg = self.config
        t0 = now - self._drop_window()
        drops: list[tuple[float, str, str]] = []
        tolerance = cfg.flap_shared_seconds
        for (name, port_name, _), remembered in self._drops.items():
            drops.extend((ts, name, port_name) for ts, _ in remembered if ts > t0)
            node = view.nodes.get(name)
            if node is not None and node.interval_seconds:
                tolerance = max(tolerance, float(node.interval_seconds))
        if len(drops) < cfg.flap_shared_min_nodes:
            return frozenset()
        drops.sort()
        times = [ts for ts, _, _ in drops]
        out = set()
        for ts, name, port_name in drops:
            near = drops[bisect_left(times, ts - tolerance):bisect_right(times, ts + tolerance)]
            if len(Counter(n for _, n, _ in near)) >= cfg.flap_shared_min_nodes:
                out.add((name, port_name, ts))
        return frozenset(out)

    def _finding(self, node: NodeState, port: PortHistory, action: Action, since: float, key: str,
                 reason: str, evidence: dict[str, object]) -> Finding:
        return Finding(detector=NAME, node=node.name, action=action, since=since, key=f"{key}:{port.name}",
                       reason=f"{port.name}: {reason}",
                       evidence={"device": port.device, "port": port.port, **evidence})

    def _judge(self, node: NodeState, port: PortHistory, now: float,
               shared: frozenset[tuple[str, str, float]] = frozenset()) -> list[Finding]:
        cfg = self.config
        out: list[Finding] = []
        last = port.last
        t0 = now - cfg.window_seconds
        if port.active_this_boot and not port_is_active(last):
            since = port.last_seen
            for sample in reversed(port.samples):
                if sample.active:
                    break
                since = sample.ts
            if now - since >= cfg.down_seconds:
                out.append(self._finding(node, port, cfg.down_action, since, "port_down",
                                         f"port {last.state or 'unknown'} for {now - since:.0f} s",
                                         {"signal": "port_state", "state": last.state, "phys_state": last.phys_state}))
                return out  # a dead port's error counters say nothing more
        if port.counters.last_increase_ts >= now - self._flap_horizon():
            out.extend(self._judge_flaps(node, port, now, shared))
        if port.counters.last_increase_ts >= t0:
            out.extend(self._judge_counters(node, port, now))
        expected = cfg.expected_rate_bits_per_second or port.max_rate_bits_per_second
        rate = last.rate_bits_per_second
        if rate and expected and rate < expected * (1 - cfg.rate_tolerance_ratio) and port_is_active(last):
            since = port.last_seen
            for sample in reversed(port.samples):
                rate_then = sample.rate_bits_per_second
                if not rate_then or rate_then >= expected * (1 - cfg.rate_tolerance_ratio):
                    break
                since = sample.ts
            if now - since >= cfg.degraded_seconds:
                out.append(self._finding(node, port, cfg.degraded_action, since, "degraded",
                                         f"link at {rate / 1e9:g} Gb/s, expected {expected / 1e9:g} Gb/s",
                                         {"signal": "rate_bits_per_second", "rate_bits_per_second": rate,
                                          "expected_rate_bits_per_second": expected}))
        return out

    def _judge_counters(self, node: NodeState, port: PortHistory, now: float) -> list[Finding]:
        """Flaps, bit errors and congestion: only for a port whose counters moved in the window."""
        cfg = self.config
        out: list[Finding] = []
        t0 = now - cfg.window_seconds
        rate = port.last.rate_bits_per_second
        errors = sum(port.counters.sum_since(c, t0) for c in cfg.error_counters)
        if rate and errors >= cfg.min_errors:
            covered = self._covered(port, cfg.error_counters, t0)
            if covered > 0:
                ber = errors / (rate * covered)
                if ber > cfg.max_bit_error_ratio:
                    out.append(self._finding(
                        node, port, cfg.error_action, self._first(port, cfg.error_counters, t0), "bit_errors",
                        f"bit error ratio {ber:.1e} over {covered:.0f} s (IBTA limit {cfg.max_bit_error_ratio:.0e})",
                        {"signal": "symbol_error_rate", "errors": errors, "bit_error_ratio": ber,
                         "rate_bits_per_second": rate, "window_seconds": round(covered, 1)}))
        for counter in cfg.congestion_counters:
            covered = port.counters.covered_seconds(counter, t0)
            if covered <= 0:
                continue
            increases = port.counters.increases_since(counter, t0)
            per_second = sum(d for _, d in increases) / covered
            if per_second >= cfg.congestion_per_second:
                out.append(self._finding(node, port, Action.OBSERVE, increases[0][0], f"congestion_{counter}",
                                         f"{counter} at {per_second:.0f}/s (fabric congestion, not a node fault)",
                                         {"signal": counter, "rate_per_second": round(per_second, 1)}))
        return out

    def _flap_horizon(self) -> float:
        cfg = self.config
        return max(cfg.window_seconds, cfg.flap_alert_window_seconds, 3600.0 * cfg.flap_persist_horizon_hours,
                   self._drop_window())

    def _judge_flaps(self, node: NodeState, port: PortHistory, now: float,
                     shared: frozenset[tuple[str, str, float]]) -> list[Finding]:
        """Link down/recovery events on the short, several-hour, slow, hourly and daily horizons;
        the strongest that holds is reported."""
        cfg = self.config
        events = sorted(e for c in cfg.flap_counters
                        for e in port.counters.increases_since(c, now - self._flap_horizon()))

        def count(t0: float, t1: float) -> float:
            return sum(d for ts, d in events if t0 < ts <= t1)

        t0 = now - cfg.window_seconds
        flaps = count(t0, now)
        if flaps >= cfg.flap_threshold:
            return [self._finding(node, port, cfg.flap_action, self._first(port, cfg.flap_counters, t0), "flap",
                                  f"{flaps:.0f} link down/recovery events in {cfg.window_seconds:.0f} s",
                                  {"signal": "link_flaps", "events": flaps, "window_seconds": cfg.window_seconds,
                                   "horizon": "short"})]
        hours = [count(now - 3600.0 * (h + 1), now - 3600.0 * h) for h in range(cfg.flap_persist_horizon_hours)]
        bad_hours = sum(1 for n in hours if n >= cfg.flap_threshold)
        if bad_hours >= cfg.flap_persist_hours:
            since = now - 3600.0 * cfg.flap_persist_horizon_hours
            return [self._finding(node, port, cfg.flap_action, self._first(port, cfg.flap_counters, since),
                                  "flap_persistent",
                                  f">= {cfg.flap_threshold} link down/recovery events in each of {bad_hours} of the "
                                  f"last {cfg.flap_persist_horizon_hours} hours ({sum(hours):.0f} in all)",
                                  {"signal": "link_flaps", "events_per_hour": hours, "horizon": "long"})]
        t_slow = now - cfg.flap_slow_window_seconds
        drops = self._port_drops(node.name, port.name, t_slow)
        own = [(ts, d) for ts, d in drops if (node.name, port.name, ts) not in shared]
        if sum(d for _, d in own) >= cfg.flap_slow_threshold:
            return [self._finding(node, port, cfg.flap_slow_action, own[0][0], "flap_slow",
                                  f"link down {sum(d for _, d in own):.0f} times in "
                                  f"{cfg.flap_slow_window_seconds / 3600.0:g} h",
                                  {"signal": "link_flaps", "events": sum(d for _, d in own),
                                   "window_seconds": cfg.flap_slow_window_seconds, "horizon": "slow",
                                   "shared_with_other_nodes": sum(d for _, d in drops) - sum(d for _, d in own)})]
        t_alert = now - cfg.flap_alert_window_seconds
        flaps = count(t_alert, now)
        if flaps >= cfg.flap_threshold:
            return [self._finding(node, port, cfg.flap_alert_action, self._first(port, cfg.flap_counters, t_alert),
                                  "flap_hourly",
                                  f"{flaps:.0f} link down/recovery events in {cfg.flap_alert_window_seconds:.0f} s",
                                  {"signal": "link_flaps", "events": flaps,
                                   "window_seconds": cfg.flap_alert_window_seconds, "horizon": "medium"})]
        t_daily = now - cfg.flap_daily_window_seconds
        daily = [(ts, d) for ts, d in self._port_drops(node.name, port.name, t_daily)
                 if (node.name, port.name, ts) not in shared]
        if sum(d for _, d in daily) >= cfg.flap_daily_threshold:
            return [self._finding(node, port, cfg.flap_daily_action, daily[0][0], "flap_daily",
                                  f"link down {sum(d for _, d in daily):.0f} times in "
                                  f"{cfg.flap_daily_window_seconds / 3600.0:g} h (a healthy link drops only "
                                  f"in maintenance): look at its cable and transceiver",
                                  {"signal": "link_flaps", "events": sum(d for _, d in daily),
                                   "window_seconds": cfg.flap_daily_window_seconds, "horizon": "daily",
                                   "drops": [round(ts, 1) for ts, _ in daily][-cfg.flap_daily_threshold:]})]
        return []

    @staticmethod
    def _first(port: PortHistory, counters: list[str], t0: float) -> float:
        firsts = [inc[0][0] for c in counters if (inc := port.counters.increases_since(c, t0))]
        return min(firsts) if firsts else port.last_seen

    @staticmethod
    def _covered(port: PortHistory, counters: list[str], t0: float) -> float:
        """Seconds since ``t0`` over which the error counters' increases are known."""
        return max((port.counters.covered_seconds(c, t0) for c in counters), default=0.0)

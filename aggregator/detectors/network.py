"""Network detector: RDMA ports that are down, flapping, erroring or trained below their rate.

It reads each port's state, rate and counters (deltas between reports of one boot). A port down,
a flapping link, a symbol/link-integrity error rate above the IBTA bit-error ratio, or a link that
retrained below the rate it had earlier in this boot drains the node: every collective through
that rail slows the whole job. Congestion counters (ECN marks, CNPs, PFC pauses) describe the
fabric, not the node: they only ever produce an ``observe`` finding.

Flaps are judged on four horizons: ``flap_threshold`` link-down/recovery events in
``window_seconds`` drains (a link retraining every few minutes); ``flap_slow_threshold`` times the
link went down (``link_downed``) within ``flap_slow_window_seconds`` drains (a port dropping every
6 minutes never fits 3 drops in 10 minutes, but its fifth drop is 24 minutes after its first);
``flap_threshold`` events within one hour alerts; that many in each of ``flap_persist_hours`` of
the last ``flap_persist_horizon_hours`` hours drains (a link that keeps retraining without going
down). Designed false-drain rate: a healthy IB link goes down a handful of times a year
(link_downed stays 0 on healthy HDR/NDR links between maintenance, and one maintenance costs a
port one or two drops: a leaf reboot, a reseated cable); 5 drops in 6 hours is ~0 false drains
by the counters. A drop that several nodes' ports took at the same moment (a switch reboot, a
fabric-wide event) is the fabric's: it does not count toward a node's slow flaps, and a shared
switch's flaps and downs across its nodes are attributed to the switch by the topology pass.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import Counter

from pydantic import Field, model_validator

from vigil.agent.validation import StrictModel
from vigil.agent.wire import PORT_TRAFFIC_COUNTERS
from vigil.aggregator.decision import Action, Finding
from vigil.aggregator.fleet import FleetView, NodeState, PortHistory, port_is_active

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


class NetworkDetector:
    name = NAME

    def __init__(self, config: NetworkConfig) -> None:
        self.config = config

    def evaluate(self, view: FleetView, now: float) -> list[Finding]:
        out: list[Finding] = []
        shared = self._shared_drops(view, now)
        for node in view.nodes.values():
            for port in node.ports.values():
                if port.last_seen < node.last_seen:
                    continue
                out.extend(self._judge(node, port, now, shared))
        return out

    def _shared_drops(self, view: FleetView, now: float) -> frozenset[tuple[str, str, float]]:
        """(node, port, ts) of the link drops within the slow window that ports of at least
        ``flap_shared_min_nodes`` nodes took at the same moment: the fabric's, not a node's."""
        cfg = self.config
        t0 = now - cfg.flap_slow_window_seconds
        drops: list[tuple[float, str, str]] = []
        tolerance = cfg.flap_shared_seconds
        for node in view.nodes.values():
            found = False
            for port in node.ports.values():
                if port.counters.last_increase_ts <= t0:
                    continue
                for counter in cfg.flap_slow_counters:
                    for ts, _ in port.counters.increases_since(counter, t0):
                        drops.append((ts, node.name, port.name))
                        found = True
            if found and node.interval_seconds:
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
                   cfg.flap_slow_window_seconds)

    def _judge_flaps(self, node: NodeState, port: PortHistory, now: float,
                     shared: frozenset[tuple[str, str, float]]) -> list[Finding]:
        """Link down/recovery events on the short, several-hour, slow and hourly horizons; the
        strongest that holds is reported."""
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
        drops = sorted(e for c in cfg.flap_slow_counters for e in port.counters.increases_since(c, t_slow)
                       if e[0] > t_slow)
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
        return []

    @staticmethod
    def _first(port: PortHistory, counters: list[str], t0: float) -> float:
        firsts = [inc[0][0] for c in counters if (inc := port.counters.increases_since(c, t0))]
        return min(firsts) if firsts else port.last_seen

    @staticmethod
    def _covered(port: PortHistory, counters: list[str], t0: float) -> float:
        """Seconds since ``t0`` over which the error counters' increases are known."""
        return max((port.counters.covered_seconds(c, t0) for c in counters), default=0.0)

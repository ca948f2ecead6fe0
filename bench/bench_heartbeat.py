"""Cost of the training-side heartbeat call (DESIGN.md section 9 budget: <= 5 us per call), and
of taking one in: the real agent's CPU per heartbeat against a bare receiver's (budget <= 1.5x).

Times ``Heartbeat.step`` sending to a bound loopback socket (the agent's case), the median of
several runs so one scheduling hiccup does not decide the figure; also reports, without a
budget, the cost with three phase timers and with nothing listening (ICMP refusals).

Intake: the real ``vigil agent`` process (bench_agent.AgentProcess, UDP, accepted unverified) and a
bare asyncio UDP receiver in a child process that only decodes each datagram into a wire Heartbeat
with msgspec run side by side for the whole measurement; the same paced stream (8 ranks,
INTAKE_RATE a second, one datagram per wake-up of the receiver as at a training job's pace) goes
to one, then the other, in interleaved rounds, so each pair of rounds shares the same minutes of a
busy machine. Each round's CPU (every thread's schedstat), less the receiver's idle rate over the
other's rounds, is divided by the datagrams it took in; the row is the median of the pairs' ratios.
Measured once each, one after the other, the ratio moved 1.09-1.82 over six runs.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.bench_agent import REPO, AgentProcess, task_cpu_seconds
from bench.measure import Measurement
from vigil.agent.collectors.training import TrainingConfig
from vigil.agent.heartbeat import Heartbeat

CALLS_PER_RUN = 20_000
RUNS = 7
INTAKE_RATE = 500  # heartbeats a second: 8 ranks at 62.5 steps a second, every datagram its own wake-up
# Rounds of each receiver, interleaved: 2 x 6 x 8 s, about 2 minutes with the agent's start.
INTAKE_ROUNDS = 6
ROUND_SECONDS = 8.0
WARM_SECONDS = 2.0
ROUND_SETTLE_SECONDS = 0.2  # after a stream, for its last datagrams' handling
INTAKE_BUDGET_RATIO = 1.5  # issue 47: the agent within 1.5x of a bare asyncio receiver
COUNT_QUERY = b"count?"
TRAINING_INTERVAL_SECONDS = TrainingConfig().interval_seconds  # how stale the agent's heartbeat counts may be


def heartbeat_payload(rank: int, step: int) -> bytes:
    """What the client sends for one step with its phase timers (vigil_heartbeat)."""
    return json.dumps({"job": "bench", "rank": rank, "step": step, "step_seconds": 1.0, "compute_seconds": 0.8,
                       "comm_seconds": 0.15, "data_seconds": 0.05, "gpu": rank, "pid": 4242 + rank,
                       "ts": 1.7e9 + step, "timing": "cuda_events"}, separators=(",", ":")).encode()


def send_paced(address: tuple[str, int], rate: float, seconds: float) -> int:
    """Heartbeats from 8 ranks to ``address`` at ``rate`` a second for ``seconds``; how many were sent."""
    sent = 0
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        start = time.monotonic()
        while (elapsed := time.monotonic() - start) < seconds:
            due = int(elapsed * rate) + 1
            while sent < due:
                sock.sendto(heartbeat_payload(sent % 8, sent // 8), address)
                sent += 1
            time.sleep(1.0 / rate)
    return sent


def bare_receiver(port_file: str) -> None:
    """The bare receiver (a child process): asyncio UDP, each datagram decoded into a Heartbeat by
    msgspec and counted; answers COUNT_QUERY with the count."""
    from vigil.contract.wire import Heartbeat as WireHeartbeat
    from vigil.contract.wire import decode

    class Receiver(asyncio.DatagramProtocol):
        def __init__(self) -> None:
            self.count = 0
            self.transport: Any = None

        def connection_made(self, transport: Any) -> None:
            self.transport = transport

        def datagram_received(self, data: bytes, addr: Any) -> None:
            if data == COUNT_QUERY:
                self.transport.sendto(str(self.count).encode(), addr)
                return
            decode(data, WireHeartbeat)
            self.count += 1

    async def serve() -> None:
        transport, _ = await asyncio.get_running_loop().create_datagram_endpoint(Receiver, local_addr=("127.0.0.1", 0))
        Path(port_file).write_text(str(transport.get_extra_info("sockname")[1]))
        await asyncio.Event().wait()

    asyncio.run(serve())


def _agent_received(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    return int(sum(float(m) for m in re.findall(r"^vigil_training_heartbeats_received_total\{[^}]*\} (\S+)$", text,
                                                re.MULTILINE)))


def _bare_received(address: tuple[str, int]) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(5)
        sock.sendto(COUNT_QUERY, address)
        return int(sock.recv(64))


@dataclass
class _Receiver:
    """One side of the comparison: its pid, where heartbeats go, how many it has taken in so far
    (read only between rounds: a /metrics scrape costs the agent milliseconds), and what it used."""

    pid: int
    address: tuple[str, int]
    received: Callable[[], int]
    busy_cpu: list[float] = field(default_factory=list)  # CPU seconds over each of its rounds
    busy_wall: list[float] = field(default_factory=list)
    sent: list[int] = field(default_factory=list)
    idle_cpu: float = 0.0  # over the other receiver's rounds, when nothing is sent to this one
    idle_wall: float = 0.0

    def per_heartbeat_us(self, taken_in: int) -> list[float]:
        """Each round's CPU per heartbeat taken in, the idle rate of the same minutes taken out.
        The kernel drops nothing at this rate on loopback (checked: ``taken_in`` against the
        sum sent); a loss would be spread over the rounds in proportion to what each sent."""
        idle_rate = self.idle_cpu / self.idle_wall
        kept = taken_in / sum(self.sent)
        return [1e6 * (cpu - idle_rate * wall) / max(sent * kept, 1.0)
                for cpu, wall, sent in zip(self.busy_cpu, self.busy_wall, self.sent, strict=True)]


def _round(busy: _Receiver, idle: _Receiver, seconds: float) -> None:
    """One stream of ``seconds`` to ``busy`` while ``idle`` gets nothing: both processes' CPU over it."""
    busy_cpu0, idle_cpu0, wall0 = task_cpu_seconds(busy.pid), task_cpu_seconds(idle.pid), time.monotonic()
    sent = send_paced(busy.address, INTAKE_RATE, seconds)
    time.sleep(ROUND_SETTLE_SECONDS)  # the last datagrams' handling
    busy_cpu1, idle_cpu1, wall1 = task_cpu_seconds(busy.pid), task_cpu_seconds(idle.pid), time.monotonic()
    busy.busy_cpu.append(busy_cpu1 - busy_cpu0)
    busy.busy_wall.append(wall1 - wall0)
    busy.sent.append(sent)
    idle.idle_cpu += idle_cpu1 - idle_cpu0
    idle.idle_wall += wall1 - wall0


def _wait_for_port(port_file: Path, bare: subprocess.Popen[bytes]) -> int:
    deadline = time.monotonic() + 30
    while not port_file.exists() or not port_file.read_text():
        if time.monotonic() > deadline or bare.poll() is not None:
            raise RuntimeError("the bare receiver did not start")
        time.sleep(0.1)
    return int(port_file.read_text())


def intake_rounds() -> tuple[list[float], list[float], tuple[int, int], tuple[int, int]]:
    """Both receivers running side by side for the whole measurement; INTAKE_ROUNDS rounds of each,
    interleaved (bare then agent, agent then bare, ...), so the pair of rounds compared shares the
    same minutes of a shared machine. Each one's idle rate is its CPU over the other's rounds.
    Returns each round's CPU per heartbeat (bare, agent) and each one's (taken in, sent)."""
    with tempfile.TemporaryDirectory(prefix="vigil-bench-intake-") as d:
        port_file = Path(d) / "port"
        bare_proc = subprocess.Popen([sys.executable, "-m", "bench.bench_heartbeat", "bare-receiver", str(port_file)],
                                     cwd=REPO)
        agent: AgentProcess | None = None
        try:
            bare_address = ("127.0.0.1", _wait_for_port(port_file, bare_proc))
            agent = AgentProcess(Path(d) / "agent")
            bare = _Receiver(bare_proc.pid, bare_address, lambda: _bare_received(bare_address))
            port = agent.port
            real = _Receiver(agent.proc.pid, agent.heartbeat_address, lambda: _agent_received(port))
            for warm in (bare, real):  # each rank's state, the caches of the path: not measured
                send_paced(warm.address, INTAKE_RATE, WARM_SECONDS)
            # The agent's count is its training collector's last cycle: read once it has run again.
            time.sleep(TRAINING_INTERVAL_SECONDS + 1.0)
            before = bare.received(), real.received()
            time.sleep(ROUND_SETTLE_SECONDS)  # the scrape's own deferred work, outside every round
            for i in range(INTAKE_ROUNDS):
                first, second = (bare, real) if i % 2 == 0 else (real, bare)
                _round(first, second, ROUND_SECONDS)
                _round(second, first, ROUND_SECONDS)
            time.sleep(TRAINING_INTERVAL_SECONDS + 1.0)
            taken_in = bare.received() - before[0], real.received() - before[1]
        finally:
            if agent is not None:
                agent.stop()
            bare_proc.terminate()
            try:
                bare_proc.wait(10)
            except subprocess.TimeoutExpired:
                bare_proc.kill()
                bare_proc.wait()
    return (bare.per_heartbeat_us(taken_in[0]), real.per_heartbeat_us(taken_in[1]),
            (taken_in[0], sum(bare.sent)), (taken_in[1], sum(real.sent)))


def measure_intake() -> list[Measurement]:
    bare_us, agent_us, (bare_got, bare_sent), (agent_got, agent_sent) = intake_rounds()
    ratios = sorted(a / b for a, b in zip(agent_us, bare_us, strict=True))
    ratio = statistics.median(ratios)
    per_round = " ".join(f"{a:.0f}/{b:.0f}" for a, b in zip(agent_us, bare_us, strict=True))
    return [
        Measurement("heartbeat intake, vigil agent process: CPU per heartbeat", statistics.median(agent_us), "us",
                    None,
                    note=f"median of {INTAKE_ROUNDS} rounds of {ROUND_SECONDS:g} s at {INTAKE_RATE}/s (UDP, 8 ranks), "
                         f"{agent_got} of {agent_sent} datagrams taken in; bare asyncio receiver with msgspec "
                         f"{statistics.median(bare_us):.0f} us ({bare_got} of {bare_sent}); agent/bare us by round: "
                         f"{per_round}"),
        Measurement("heartbeat intake, vigil agent process / bare asyncio receiver", ratio, "x",
                    INTAKE_BUDGET_RATIO,
                    note=f"median of {INTAKE_ROUNDS} interleaved round pairs, both processes running throughout; "
                         f"range {ratios[0]:.2f}-{ratios[-1]:.2f}; CPU per heartbeat, each one's idle rate "
                         "(over the other's rounds) taken out"),
    ]


def _median_us(run: Callable[[int], None]) -> float:
    per_call = []
    for _ in range(RUNS):
        start = time.perf_counter()
        run(CALLS_PER_RUN)
        per_call.append((time.perf_counter() - start) / CALLS_PER_RUN * 1e6)
    return statistics.median(per_call)


def measure() -> list[Measurement]:
    receiver = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    receiver.bind(("127.0.0.1", 0))
    # Nobody reads it: the kernel drops what overflows its buffer, which the sender never sees.
    try:
        with Heartbeat(job="bench", rank=0, gpu=0, addr=receiver.getsockname(), env={}) as hb:

            def plain(n: int) -> None:
                for i in range(n):
                    hb.step(i, 0.5)

            def phased(n: int) -> None:
                for i in range(n):
                    with hb.phase("data"):
                        pass
                    with hb.phase("compute"):
                        pass
                    with hb.phase("comm"):
                        pass
                    hb.step(i)

            plain_us = _median_us(plain)
            phased_us = _median_us(phased)
            dropped = hb.dropped
    finally:
        receiver.close()

    closed = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    with Heartbeat(job="bench", rank=0, addr=("127.0.0.1", port), env={}) as lonely:

        def unheard(n: int) -> None:
            for i in range(n):
                lonely.step(i, 0.5)

        unheard_us = _median_us(unheard)

    return [
        *measure_intake(),
        Measurement("heartbeat client call", plain_us, "us", 5.0,
                    note=f"UDP send to a bound loopback socket, median of {RUNS}x{CALLS_PER_RUN}; "
                         f"{dropped} dropped"),
        Measurement("heartbeat client call with 3 phase timers", phased_us, "us", None,
                    note="data, compute and comm context managers plus the step call"),
        Measurement("heartbeat client call, no agent listening", unheard_us, "us", None,
                    note="ICMP refusals make every other send fail; the error is swallowed"),
    ]


if __name__ == "__main__":
    if sys.argv[1:2] == ["bare-receiver"]:
        bare_receiver(sys.argv[2])
        sys.exit(0)
    for m in measure_intake() if sys.argv[1:] == ["intake"] else measure():
        print(f"{m.what:50s} {m.value:8.2f} {m.unit:3s} budget {m.budget}  {m.note}")

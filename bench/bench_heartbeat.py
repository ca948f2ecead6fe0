"""Cost of the training-side heartbeat call (DESIGN.md section 9 budget: <= 5 us per call), and
of taking one in: the real agent's CPU per heartbeat against a bare receiver's (budget <= 1.5x).

Times ``Heartbeat.step`` sending to a bound loopback socket (the agent's case), the median of
several runs so one scheduling hiccup does not decide the figure; also reports, without a
budget, the cost with three phase timers and with nothing listening (ICMP refusals).

Intake: the same paced stream of heartbeats (8 ranks, INTAKE_RATE a second, one datagram per
wake-up of the receiver as at a training job's pace) goes to the real ``vigil agent`` process
(bench_agent.AgentProcess, UDP, accepted unverified) and to a bare asyncio UDP receiver in a
child process that only decodes each datagram into a wire Heartbeat with msgspec; each one's CPU
over the stream (every thread's schedstat), less its idle rate, is divided by the datagrams it
received.
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
from pathlib import Path
from typing import Any

from bench.bench_agent import REPO, AgentProcess, task_cpu_seconds
from bench.measure import Measurement
from vigil.agent.collectors.training import TrainingConfig
from vigil.agent.heartbeat import Heartbeat

CALLS_PER_RUN = 20_000
RUNS = 7
INTAKE_RATE = 500  # heartbeats a second: 8 ranks at 62.5 steps a second, every datagram its own wake-up
INTAKE_SECONDS = 10.0
IDLE_SECONDS = 8.0
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


def _intake_us(pid: int, address: tuple[str, int], received: Callable[[], int],
               count_delay_seconds: float = 0.0) -> tuple[float, int, int]:
    """CPU microseconds per heartbeat the process ``pid`` received, its idle rate taken out;
    ``received`` is read ``count_delay_seconds`` after the stream (the agent's /metrics show
    the training collector's last cycle)."""
    cpu0, wall0 = task_cpu_seconds(pid), time.monotonic()
    time.sleep(IDLE_SECONDS)
    cpu1, wall1 = task_cpu_seconds(pid), time.monotonic()
    idle_per_second = (cpu1 - cpu0) / (wall1 - wall0)
    before = received()
    cpu1, wall1 = task_cpu_seconds(pid), time.monotonic()
    sent = send_paced(address, INTAKE_RATE, INTAKE_SECONDS)
    time.sleep(0.2)  # the last datagrams' handling
    cpu2, wall2 = task_cpu_seconds(pid), time.monotonic()
    time.sleep(count_delay_seconds)
    got = received() - before
    return 1e6 * ((cpu2 - cpu1) - idle_per_second * (wall2 - wall1)) / max(got, 1), got, sent


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


def measure_intake() -> list[Measurement]:
    with tempfile.TemporaryDirectory(prefix="vigil-bench-intake-") as d:
        port_file = Path(d) / "port"
        bare = subprocess.Popen([sys.executable, "-m", "bench.bench_heartbeat", "bare-receiver", str(port_file)],
                                cwd=REPO)
        try:
            deadline = time.monotonic() + 30
            while not port_file.exists() or not port_file.read_text():
                if time.monotonic() > deadline or bare.poll() is not None:
                    raise RuntimeError("the bare receiver did not start")
                time.sleep(0.1)
            address = ("127.0.0.1", int(port_file.read_text()))
            bare_us, bare_got, bare_sent = _intake_us(bare.pid, address, lambda: _bare_received(address))
        finally:
            bare.terminate()
            try:
                bare.wait(10)
            except subprocess.TimeoutExpired:
                bare.kill()
                bare.wait()
        agent = AgentProcess(Path(d) / "agent")
        try:
            agent_us, agent_got, agent_sent = _intake_us(agent.proc.pid, agent.heartbeat_address,
                                                         lambda: _agent_received(agent.port),
                                                         TRAINING_INTERVAL_SECONDS + 1.0)
        finally:
            agent.stop()
    return [
        Measurement("heartbeat intake, vigil agent process: CPU per heartbeat", agent_us, "us", None,
                    note=f"{agent_got} of {agent_sent} datagrams taken in at {INTAKE_RATE}/s (UDP, 8 ranks); "
                         f"bare asyncio receiver with msgspec {bare_us:.0f} us ({bare_got} of {bare_sent})"),
        Measurement("heartbeat intake, vigil agent process / bare asyncio receiver", agent_us / bare_us, "x",
                    INTAKE_BUDGET_RATIO, note="CPU per heartbeat, each process's idle rate taken out"),
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

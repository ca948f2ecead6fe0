"""Cost of the training-side heartbeat call (DESIGN.md section 9 budget: <= 5 us per call).

Times ``Heartbeat.step`` sending to a bound loopback socket (the agent's case), the median of
several runs so one scheduling hiccup does not decide the figure; also reports, without a
budget, the cost with three phase timers and with nothing listening (ICMP refusals).
"""

from __future__ import annotations

import socket
import statistics
import time
from collections.abc import Callable

from bench.measure import Measurement
from vigil.agent.heartbeat import Heartbeat

CALLS_PER_RUN = 20_000
RUNS = 7


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
        Measurement("heartbeat client call", plain_us, "us", 5.0,
                    note=f"UDP send to a bound loopback socket, median of {RUNS}x{CALLS_PER_RUN}; "
                         f"{dropped} dropped"),
        Measurement("heartbeat client call with 3 phase timers", phased_us, "us", None,
                    note="data, compute and comm context managers plus the step call"),
        Measurement("heartbeat client call, no agent listening", unheard_us, "us", None,
                    note="ICMP refusals make every other send fail; the error is swallowed"),
    ]


if __name__ == "__main__":
    for m in measure():
        print(f"{m.what:50s} {m.value:8.2f} {m.unit:3s} budget {m.budget}  {m.note}")

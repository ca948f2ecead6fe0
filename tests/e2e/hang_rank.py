"""One rank of a plain data-parallel job that hangs, for the hang tests and bench_hang: it sends a
heartbeat step every ``step_seconds`` from the shared wall-clock ``start`` until ``stop_step``, then
stays alive without stepping (a collective that never returns), as every rank of a plain DDP hang
does: all ranks stop at the same step at the same moment. Identity comes from the environment
(RANK, LOCAL_RANK, VIGIL_HEARTBEAT_ADDR), as torchrun and docs/training.md set it. The caller stops
it by pid; it also ends by itself after ``linger`` seconds, so nothing outlives a test.

argv: start (Unix seconds), step_seconds, stop_step, linger_seconds
"""

import sys
import time

from vigil_heartbeat import Heartbeat


def main() -> int:
    start, step_seconds, stop_step, linger = (float(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]),
                                              float(sys.argv[4]))
    hb = Heartbeat()
    for step in range(1, stop_step + 1):
        time.sleep(max(0.0, start + step * step_seconds - time.time()))
        hb.step(step, step_seconds)
    time.sleep(linger)  # hung: alive, never stepping again
    hb.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A collector whose source polls is run when the source has something, not only at its interval:
the xid collector on /dev/kmsg (here a FIFO, which polls as the device does) reads a logged Xid at
once while its quiet cycle is an hour away, sleeps at the seconds it asks for otherwise, is never
run faster than its interval by a source that stays readable, and falls back to its interval where
the descriptor cannot be watched or a timed-out call still holds it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path

import pytest

from vigil.agent.collectors.collector import Collection, Wakeable
from vigil.agent.collectors.xid import XidCollector, XidConfig
from vigil.agent.file_follower import FileFollower
from vigil.agent.kernel_log_readers import KmsgReader, StreamReader
from vigil.agent.metric import MetricKind, MetricSpec, Sample
from vigil.agent.runner import Runner
from vigil.agent.snapshot import Snapshot

VALUE = MetricSpec("vigil_test_value", MetricKind.GAUGE, "test")
HOUR = 3600.0
XID79 = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus."


async def _until(predicate: Callable[[], bool], seconds: float = 10.0) -> None:
    async with asyncio.timeout(seconds):
        while not predicate():
            await asyncio.sleep(0.01)


@pytest.fixture
def fifo(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    """A FIFO standing in for /dev/kmsg, with the test's write end held open (a FIFO without a
    writer polls as hung up, which the device never does)."""
    path = tmp_path / "kmsg"
    os.mkfifo(path)
    writer = os.open(path, os.O_RDWR | os.O_NONBLOCK)
    try:
        yield path, writer
    finally:
        os.close(writer)


class Piped:
    """A Wakeable collector over a pipe: each call drains it and counts the bytes read."""

    name = "piped"
    specs: Sequence[MetricSpec] = (VALUE,)

    def __init__(self, fd: int | None, seconds: float, block: threading.Event | None = None,
                 drain: bool = True) -> None:
        self.fd = fd
        self.seconds = seconds
        self.block = block
        self.drain = drain
        self.calls = 0
        self.read = 0
        self.asked = 0

    def collect(self, now: float) -> Collection:
        self.calls += 1
        if self.block is not None:
            self.block.wait(5)
        while self.fd is not None and self.drain:
            try:
                chunk = os.read(self.fd, 4096)
            except BlockingIOError:
                break
            if not chunk:
                break
            self.read += len(chunk)
        return Collection(samples=[Sample.of(VALUE, self.read)])

    def wake(self, now: float) -> tuple[int, float] | None:
        self.asked += 1
        return None if self.fd is None else (self.fd, self.seconds)

    def close(self) -> None:
        pass


def _read(c: Piped, total: int) -> Callable[[], bool]:
    return lambda: c.read == total


@pytest.fixture
def pipe() -> Iterator[tuple[int, int]]:
    """(read end, non-blocking; write end), closed after the test."""
    r, w = os.pipe()
    os.set_blocking(r, False)
    try:
        yield r, w
    finally:
        os.close(r)
        os.close(w)


@contextlib.asynccontextmanager
async def _running(c: Piped, interval: float, timeout: float = 5.0) -> AsyncIterator[Runner]:
    """The runner over ``c`` alone at ``interval``, stopped (and its cycles finished) on exit."""
    runner = Runner([c], {c.name: (interval, timeout)}, Snapshot(), on_events=lambda _: None)
    stop = asyncio.Event()
    task = asyncio.create_task(runner.run(stop))
    try:
        yield runner
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)


async def test_a_readable_descriptor_starts_a_cycle_long_before_the_interval(pipe: tuple[int, int]) -> None:
    r, w = pipe
    c = Piped(r, HOUR)
    assert isinstance(c, Wakeable)
    async with _running(c, 0.01):
        await _until(lambda: c.calls == 1 and c.asked == 1)  # the first cycle, then the watch
        for n, total in ((1, 1), (2, 3), (3, 6)):
            os.write(w, b"x" * n)
            await _until(_read(c, total))
    assert c.calls == 4  # one cycle a write, none at the 0.01 s interval nor the hour's quiet one


async def test_a_quiet_descriptor_runs_at_the_seconds_the_collector_asks_for(pipe: tuple[int, int]) -> None:
    c = Piped(pipe[0], 0.02)
    async with _running(c, HOUR):
        await _until(lambda: c.calls >= 5)  # an hour's interval, yet cycles every 0.02 s


async def test_a_source_that_stays_readable_is_read_at_the_interval_not_faster(pipe: tuple[int, int]) -> None:
    r, w = pipe
    c = Piped(r, HOUR, drain=False)  # a flood beyond what a cycle takes: readable after every one
    os.write(w, b"flood")
    async with _running(c, 0.1):
        await _until(lambda: c.calls >= 3)
        await asyncio.sleep(0.5)
    assert c.asked >= 3 and c.calls <= 12  # ~one cycle per 0.1 s, not one per loop pass


async def test_a_descriptor_the_loop_cannot_watch_leaves_the_collector_on_its_interval(tmp_path: Path) -> None:
    regular = tmp_path / "log"
    regular.write_text("")
    fd = os.open(regular, os.O_RDONLY)  # epoll refuses a regular file
    try:
        c = Piped(fd, HOUR)
        async with _running(c, 0.02):
            await _until(lambda: c.calls >= 5)  # at its 0.02 s interval, not the hour it asked for
    finally:
        os.close(fd)


async def test_a_timed_out_call_still_running_is_not_woken_by_what_it_has_not_read(pipe: tuple[int, int]) -> None:
    r, w = pipe
    gate = threading.Event()
    c = Piped(r, HOUR, block=gate)
    os.write(w, b"pending")  # readable all along: a watch would start (and skip) a cycle every loop pass
    async with _running(c, 0.05, timeout=0.05) as runner:
        await _until(lambda: runner._skipped["piped"] >= 3)
        await asyncio.sleep(0.25)
        skipped = runner._skipped["piped"]
        assert c.asked == 0 and skipped < 20  # ~one due cycle per 0.05 s, not one per loop pass
        gate.set()
        await _until(lambda: c.read == len(b"pending"))


def test_only_a_source_that_polls_gives_a_descriptor(tmp_path: Path, fifo: tuple[Path, int]) -> None:
    regular = tmp_path / "kern.log"
    regular.write_text("")
    on_file = KmsgReader(regular)  # a regular file standing in for the device: read at intervals
    assert on_file.read_lines(10) == [] and on_file.wake_fd() is None
    on_fifo = KmsgReader(fifo[0])
    assert on_fifo.wake_fd() is None  # not open before its first read
    assert on_fifo.read_lines(10) == [] and on_fifo.wake_fd() is not None
    on_fifo.close()
    assert on_fifo.wake_fd() is None
    on_file.close()
    assert FileFollower(regular).wake_fd() is None
    stream = StreamReader(iter(()))  # type: ignore[arg-type]
    assert stream.wake_fd() is None


def test_the_xid_collector_asks_to_be_woken_sooner_when_a_folded_count_is_due(fifo: tuple[Path, int]) -> None:
    path, writer = fifo
    c = XidCollector(XidConfig(forward_interval_seconds=10.0), open_source=lambda: KmsgReader(path),
                     boot_id_path=Path("/nonexistent/boot_id"))
    assert c.wake(0.0) is None  # no source open yet: the first cycle is at the interval
    c.collect(100.0)
    wake = c.wake(100.0)
    assert wake is not None and wake[1] == 5.0  # nothing pending: wake_interval_seconds
    os.write(writer, f"3,1,1000,-;{XID79}\n".encode())
    assert [e.count for e in c.collect(101.0).events] == [1]  # the first at once
    os.write(writer, f"3,2,2000,-;{XID79}\n".encode())
    assert c.collect(102.0).events == []  # the second folded until 111
    assert c.wake(108.0) == (wake[0], 3.0)  # its count is due at 111, before 108 + 5
    assert c.wake(110.9) == (wake[0], 0.5)  # never sooner than the interval
    assert [e.count for e in c.collect(111.0).events] == [1]
    assert c.wake(111.0) == (wake[0], 5.0)
    c.close()
    assert c.wake(112.0) is None


async def test_a_logged_xid_is_read_at_once_while_the_quiet_cycle_is_an_hour_away(fifo: tuple[Path, int]) -> None:
    path, writer = fifo
    c = XidCollector(XidConfig(interval_seconds=0.01, wake_interval_seconds=HOUR),
                     open_source=lambda: KmsgReader(path), boot_id_path=Path("/nonexistent/boot_id"))
    events: list[int | None] = []
    got = asyncio.Event()

    def on_events(col: Collection) -> None:
        events.extend(e.code for e in col.events)
        got.set()

    snap = Snapshot()
    runner = Runner([c], {"xid": (0.01, 5.0)}, snap, on_events=on_events)
    stop = asyncio.Event()
    task = asyncio.create_task(runner.run(stop))
    await _until(lambda: "xid" in snap.results())  # the first cycle opened the device
    await asyncio.sleep(0)  # its completion's callback set the watch
    os.write(writer, f"3,7,7000,-;{XID79}\n".encode())
    await asyncio.wait_for(got.wait(), 5)
    assert events == [79]
    stop.set()
    await asyncio.wait_for(task, 5)

"""The training-side client: never raises, never blocks, reads its identity from the launcher."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from tests.loopback import free_port
from vigil.agent.heartbeat import Heartbeat, resolve_addr, resolve_identity
from vigil.contract.wire import Heartbeat as WireHeartbeat
from vigil.contract.wire import convert, decode


class FakeClock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def receiver():
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(2.0)
    yield sock
    sock.close()


_free_port = free_port


def test_import_pulls_in_no_agent_dependencies():
    code = ("import sys, agent.heartbeat; "
            "bad = [m for m in ('aiohttp', 'pynvml', 'prometheus_client', 'pydantic', 'msgspec', 'yaml', 'psutil') "
            "if m in sys.modules]; print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.stdout.strip() == ""


def test_datagram_is_a_valid_wire_heartbeat(receiver):
    hb = Heartbeat(job="llama-70b", rank=3, gpu=5, addr=receiver.getsockname(), env={})
    hb.step(1200, 0.84, compute_seconds=0.61, comm_seconds=0.2, data_seconds=0.03)
    msg = convert(json.loads(receiver.recv(4096)), WireHeartbeat)
    assert (msg.job, msg.rank, msg.gpu, msg.step) == ("llama-70b", 3, 5, 1200)
    assert msg.step_seconds == pytest.approx(0.84)
    assert msg.compute_seconds == pytest.approx(0.61)
    assert msg.comm_seconds == pytest.approx(0.2)
    assert msg.data_seconds == pytest.approx(0.03)
    assert msg.pid == os.getpid()
    assert msg.ts is not None
    assert hb.sent == 1 and hb.dropped == 0


def test_phases_are_timed_and_step_time_is_wall_time_since_previous_step(receiver):
    clock = FakeClock()
    hb = Heartbeat(job="j", rank=0, addr=receiver.getsockname(), env={}, clock=clock)
    clock.t += 0.5
    with hb.phase("data"):
        clock.t += 0.25
    with hb.phase("compute"):
        clock.t += 2.0
    with hb.phase("allreduce"):  # an alias of comm
        clock.t += 0.75
    with hb.phase("compute"):  # a second compute span in the same step adds up
        clock.t += 1.0
    hb.step(7)
    first = json.loads(receiver.recv(4096))
    assert first["step_seconds"] == pytest.approx(4.5)
    assert first["compute_seconds"] == pytest.approx(3.0)
    assert first["comm_seconds"] == pytest.approx(0.75)
    assert first["data_seconds"] == pytest.approx(0.25)
    clock.t += 1.5
    hb.step(8)  # phases reset after each step: none timed, none sent
    second = json.loads(receiver.recv(4096))
    assert second["step_seconds"] == pytest.approx(1.5)
    assert "compute_seconds" not in second and "comm_seconds" not in second


def test_no_exception_and_no_blocking_with_nothing_listening():
    hb = Heartbeat(job="j", rank=0, addr=("127.0.0.1", _free_port()), env={})
    for step in range(2000):  # ICMP port-unreachable turns some sends into ECONNREFUSED
        hb.step(step, 0.1)
    assert hb.sent + hb.dropped == 2000
    assert hb._sock is not None and hb._sock.getblocking() is False


@pytest.mark.parametrize("addr", [("256.0.0.1", 9401), ("127.0.0.1", -1), ("127.0.0.1", 70000)])
def test_invalid_address_drops_without_raising(addr):
    hb = Heartbeat(job="j", rank=0, addr=addr, env={})
    hb.step(1, 0.1)
    with hb.phase("compute"):
        pass
    hb.step(2)
    assert hb.sent == 0 and hb.dropped == 2


def test_closed_client_drops_without_raising(receiver):
    hb = Heartbeat(job="j", rank=0, addr=receiver.getsockname(), env={})
    hb.close()
    hb.step(1, 0.1)
    assert hb.dropped == 1


def test_unusable_values_are_dropped_not_raised(receiver):
    hb = Heartbeat(job="j", rank=0, addr=receiver.getsockname(), env={})
    hb.step("not a number", 0.1)  # type: ignore[arg-type]
    hb.step(3, "slow")  # type: ignore[arg-type]
    assert hb.dropped == 2 and hb.sent == 0
    with hb.phase("no-such-phase"):  # an unknown phase times nothing and raises nothing
        pass
    hb.step(4, 0.2)
    assert set(json.loads(receiver.recv(4096))) == {"job", "rank", "pid", "step", "step_seconds", "ts"}


def test_job_names_are_escaped(receiver):
    hb = Heartbeat(job='a"b\\c\n', rank=1, addr=receiver.getsockname(), env={})
    hb.step(1, 0.1)
    assert json.loads(receiver.recv(4096))["job"] == 'a"b\\c\n'


def test_torchrun_environment():
    env = {"TORCHELASTIC_RUN_ID": "gpt-run-7", "RANK": "13", "LOCAL_RANK": "5", "SLURM_JOB_ID": "991"}
    assert resolve_identity(env) == ("gpt-run-7", 13, 5)
    hb = Heartbeat(env=env, addr=("127.0.0.1", 9))
    assert (hb.job, hb.rank, hb.gpu) == ("gpt-run-7", 13, 5)


def test_slurm_environment_and_torchrun_default_run_id():
    # torchrun without --rdzv-id exports the literal "none": the Slurm job id names the job.
    env = {"TORCHELASTIC_RUN_ID": "none", "SLURM_JOB_ID": "4242", "SLURM_PROCID": "17", "SLURM_LOCALID": "1"}
    assert resolve_identity(env) == ("4242", 17, 1)


def test_explicit_arguments_win_over_environment():
    env = {"SLURM_JOB_ID": "4242", "SLURM_PROCID": "17", "SLURM_LOCALID": "1"}
    hb = Heartbeat(job="mine", rank=0, gpu=7, env=env, addr=("127.0.0.1", 9))
    assert (hb.job, hb.rank, hb.gpu) == ("mine", 0, 7)


def test_no_launcher_environment():
    assert resolve_identity({"RANK": "x"}) == ("local", 0, None)


def test_address_from_environment(receiver):
    host, port = receiver.getsockname()
    assert resolve_addr({"VIGIL_HEARTBEAT_ADDR": f"{host}:{port}"}) == (host, port)
    assert resolve_addr({"VIGIL_HEARTBEAT_ADDR": "[::1]:9500"}) == ("::1", 9500)
    assert resolve_addr({"VIGIL_HEARTBEAT_ADDR": "nonsense"}) == ("127.0.0.1", 9401)
    hb = Heartbeat(job="j", rank=0, env={"VIGIL_HEARTBEAT_ADDR": f"{host}:{port}"})
    hb.step(1, 0.1)
    assert json.loads(receiver.recv(4096))["step"] == 1


def test_example_training_loop_heartbeats_are_accepted_by_the_collector(tmp_path):
    """The shipped example, as a real process, over a Unix socket: each datagram carries the
    example's pid as the kernel knows it; keyed by its (here: given) Slurm job, its own name a label."""
    from vigil.agent.attribution import Sender
    from vigil.agent.collectors.training import TrainingCollector, TrainingConfig
    from vigil.agent.server import credentials_of

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = str(tmp_path / "heartbeat.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        listener.bind(path)
        listener.settimeout(5.0)
        env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": f"{root}:{root}/clients/heartbeat",
               "VIGIL_HEARTBEAT_ADDR": f"unix:{path}", "RANK": "2", "LOCAL_RANK": "2"}
        child = subprocess.Popen([sys.executable, os.path.join(root, "examples", "train_loop.py"), "3"], env=env,
                                 stdout=subprocess.PIPE, text=True)
        out, _ = child.communicate(timeout=60)
        assert child.returncode == 0 and "sent 3 heartbeats, dropped 0" in out
        collector = TrainingCollector(TrainingConfig(), pid_alive=lambda pid: True)
        for _ in range(3):
            data, ancillary, _, _ = listener.recvmsg(4096, socket.CMSG_SPACE(12))
            credentials = credentials_of(ancillary)
            assert credentials is not None
            pid, uid, _ = credentials
            assert (pid, uid) == (child.pid, os.getuid())
            assert collector.ingest(data, 1000.0, Sender("scheduler", job="4242", pid=pid, uid=uid)) is None
    collection = collector.collect(1005.0)  # the window [1000, 1005) is complete
    (summary,) = collection.report["ranks"]
    assert (summary.job, summary.rank, summary.gpu, summary.last_step, summary.steps) == ("4242", 2, 2, 3, 3)
    assert summary.pid == child.pid
    assert summary.compute_seconds_p50 is not None and summary.data_seconds_p50 is not None
    assert summary.step_seconds_p50 is not None and summary.step_seconds_p50 >= summary.compute_seconds_p50
    (info,) = [s for s in collection.samples if s.name == "vigil_training_job_info"]
    assert dict(info.labels) == {"job": "4242", "trust": "scheduler", "name": "example"}


def test_the_unix_socket_is_the_default_where_its_directory_exists(tmp_path) -> None:
    """Without VIGIL_HEARTBEAT_ADDR the client sends to the agent's socket when its directory is
    there (on the host, or mounted into a pod), and falls back to UDP only where it is not."""
    path = str(tmp_path / "vigil" / "heartbeat.sock")
    assert resolve_addr({}, path) == ("127.0.0.1", 9401)
    os.mkdir(tmp_path / "vigil")
    assert resolve_addr({}, path) == path
    assert resolve_addr({"VIGIL_HEARTBEAT_ADDR": "127.0.0.1:9401"}, path) == ("127.0.0.1", 9401)  # explicit
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as listener:
        listener.bind(path)
        listener.settimeout(2.0)
        hb = Heartbeat(job="j", rank=1, env={}, unix_path=path)
        hb.step(1, 1.0)
        assert decode(listener.recv(4096), WireHeartbeat).step == 1
        hb.close()


def test_an_unencodable_job_name_never_raises(receiver):
    hb = Heartbeat(job="bad\ud800name", rank=0, addr=receiver.getsockname(), env={})
    hb.step(1, 0.1)
    assert json.loads(receiver.recv(4096))["job"] == "bad?name" and hb.dropped == 0


def test_a_unix_socket_address_reaches_a_listener_that_starts_later(tmp_path) -> None:
    """From a pod: VIGIL_HEARTBEAT_ADDR=unix:PATH. The agent may start after the training process
    (steps before that are dropped and counted), and is found without reconnecting."""
    path = str(tmp_path / "heartbeat.sock")
    assert resolve_addr({"VIGIL_HEARTBEAT_ADDR": f"unix:{path}"}) == path
    hb = Heartbeat(job="j", rank=2, env={"VIGIL_HEARTBEAT_ADDR": f"unix:{path}"}, clock=FakeClock())
    hb.step(1, 1.0)  # no listener yet
    assert (hb.sent, hb.dropped) == (0, 1)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as listener:
        listener.bind(path)
        listener.settimeout(2.0)
        hb.step(2, 1.0)
        got = decode(listener.recv(4096), WireHeartbeat)
    assert (got.job, got.rank, got.step) == ("j", 2, 2) and (hb.sent, hb.dropped) == (1, 1)
    hb.close()

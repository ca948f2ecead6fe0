"""Heartbeats are local (issue 12 point 4), proved across a real network boundary.

Two network namespaces joined by a veth pair: the agent runs in one (/metrics on 0.0.0.0, as
deployed), a "remote host" in the other. Two agents: one with the deployed heartbeat listener
(127.0.0.1), where the remote host's datagrams and connections are refused by the kernel and its
POST to the /metrics listener is refused with 403 and counted; and one misconfigured to listen for
heartbeats on 0.0.0.0, where the peer check refuses and counts every remote heartbeat. A sender on
the agent's own node (UDP, HTTP and the Unix socket) is accepted by both: both agents opt in to
unverified UDP/HTTP heartbeats (keyed unverified/<name>) and to senders in no scheduler's cgroup
(the test's own processes, keyed uid/<uid>/<name>); test_heartbeat_identity.py covers who may
claim which job.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

AGENT_IP, REMOTE_IP = "10.231.7.1", "10.231.7.2"
DEPLOYED = {"metrics": 19400, "heartbeat": 9401}  # heartbeats on 127.0.0.1 (deploy/config/agent.yml)
WIDE = {"metrics": 9500, "heartbeat": 9501}  # heartbeats misconfigured on 0.0.0.0: the peer check holds
REMOTE_DATAGRAMS = 5
LOCAL = {"udp": 3, "http": 1, "unix": 2}


def _run(*argv: str, timeout: float = 20) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture
def namespaces() -> Iterator[tuple[str, str]]:
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (ip netns add); run the suite as root to prove local-only heartbeats")
    if shutil.which("ip") is None:
        pytest.skip("iproute2's `ip` is not installed: cannot create network namespaces")
    tag = f"{os.getpid() % 100000}"
    agent_ns, remote_ns = f"vigil-a{tag}", f"vigil-r{tag}"
    veth_a, veth_r = f"vga{tag}", f"vgr{tag}"
    made: list[str] = []
    try:
        for ns in (agent_ns, remote_ns):
            done = _run("ip", "netns", "add", ns)
            if done.returncode != 0:
                pytest.skip(f"`ip netns add` is unavailable here: {done.stderr.strip()}")
            made.append(ns)
        steps = [
            ("ip", "link", "add", veth_a, "type", "veth", "peer", "name", veth_r),
            ("ip", "link", "set", veth_a, "netns", agent_ns),
            ("ip", "link", "set", veth_r, "netns", remote_ns),
            ("ip", "-n", agent_ns, "addr", "add", f"{AGENT_IP}/30", "dev", veth_a),
            ("ip", "-n", remote_ns, "addr", "add", f"{REMOTE_IP}/30", "dev", veth_r),
            ("ip", "-n", agent_ns, "link", "set", veth_a, "up"),
            ("ip", "-n", remote_ns, "link", "set", veth_r, "up"),
            ("ip", "-n", agent_ns, "link", "set", "lo", "up"),
            ("ip", "-n", remote_ns, "link", "set", "lo", "up"),
        ]
        for step in steps:
            done = _run(*step)
            assert done.returncode == 0, f"{' '.join(step)}: {done.stderr}"
        yield agent_ns, remote_ns
    finally:
        for ns in made:
            _run("ip", "netns", "del", ns)  # takes the veth pair with it


class AgentInNamespace:
    """``vigil agent`` inside a namespace, bounded in time and stopped by its pid."""

    def __init__(self, ns: str, tmp: Path, ports: dict[str, int], heartbeat_host: str, unix_socket: Path) -> None:
        kmsg = tmp / f"kern-{ports['metrics']}.log"
        kmsg.write_text("")
        config = {
            "node": "gpu-a1",
            "listen": f"0.0.0.0:{ports['metrics']}",
            "collectors": {
                "training": {"udp_listen": f"{heartbeat_host}:{ports['heartbeat']}", "interval_seconds": 0.2,
                             "unix_socket": str(unix_socket), "accept_unverified": True, "unscheduled": "by_uid"},
                "xid": {"source": "file", "path": str(kmsg)},
            },
        }
        path = tmp / f"agent-{ports['metrics']}.json"
        path.write_text(json.dumps(config))  # JSON is YAML
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, "-m", "vigil", "agent", "--config", str(path),
             "--backend", "fake"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if "heartbeats on" in line:
                self.ready.set()

    def wait_ready(self) -> None:
        if not self.ready.wait(30):
            self.stop()
            raise AssertionError("agent did not start within 30 s:\n" + "".join(self.lines))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # by pid: `ip netns exec` execs the agent in place
            self.proc.wait(5)
        self._reader.join(5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


# Run inside a namespace: send heartbeats the way a remote host (or a local process) would, and
# report what happened to each, as JSON on stdout.
SENDER = r"""
import json, socket, sys, urllib.error, urllib.request
target, plan = sys.argv[1], json.loads(sys.argv[2])
out = {}
def hb(job):
    return json.dumps({"job": job, "rank": 0, "step": 1, "step_seconds": 1.0}).encode()
def post(url, job):
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=hb(job), method="POST"), timeout=5) as r:
            return [r.status, json.loads(r.read())]
    except urllib.error.HTTPError as e:
        with e:
            return [e.code, json.loads(e.read())]
    except OSError as e:
        return ["oserror", type(e).__name__]
for name, (kind, port, job, n) in plan.items():
    if kind in ("udp", "udp-send"):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.connect((target, port))
        s.settimeout(2)
        refused = False
        for _ in range(n):
            try:
                s.send(hb(job))
            except ConnectionRefusedError:  # the ICMP answer to an earlier datagram
                refused = True
        if refused:
            out[name] = "refused"
            s.close()
            continue
        if kind == "udp-send":
            out[name] = "sent"
            s.close()
            continue
        try:
            s.recv(1)  # a closed port answers ICMP port unreachable: ECONNREFUSED here
            out[name] = "answered"
        except ConnectionRefusedError:
            out[name] = "refused"
        except TimeoutError:
            out[name] = "sent"
        s.close()
    elif kind == "unix":
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        for _ in range(n):
            s.sendto(hb(job), port)
        s.close()
        out[name] = "sent"
    elif kind == "http":
        out[name] = post(f"http://{target}:{port}/v1/heartbeat", job)
    elif kind == "metrics":
        try:
            out[name] = urllib.request.urlopen(f"http://{target}:{port}/metrics", timeout=5).read().decode()
        except OSError as e:
            out[name] = type(e).__name__
print(json.dumps(out))
"""

# Run in the agent's namespace: poll both agents' /metrics until the local heartbeats show.
WAIT_METRICS = r"""
import json, sys, time, urllib.request
wants, ports = json.loads(sys.argv[1]), [int(p) for p in sys.argv[2:]]
deadline = time.monotonic() + 15
while True:
    texts = [urllib.request.urlopen(f"http://127.0.0.1:{p}/metrics", timeout=5).read().decode() for p in ports]
    if all(w in t for t in texts for w in wants) or time.monotonic() > deadline:
        break
    time.sleep(0.1)
print("\n#####\n".join(texts))
"""


def _send(ns: str, target: str, plan: dict[str, list[object]]) -> dict[str, Any]:
    done = _run("ip", "netns", "exec", ns, sys.executable, "-c", SENDER, target, json.dumps(plan), timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _value(text: str, series: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return None


def test_remote_heartbeats_are_refused_and_counted_local_ones_accepted(
        namespaces: tuple[str, str], tmp_path: Path) -> None:
    agent_ns, remote_ns = namespaces
    sock_dir = tmp_path / "run"
    sock_dir.mkdir()
    deployed = AgentInNamespace(agent_ns, tmp_path, DEPLOYED, "127.0.0.1", sock_dir / "deployed.sock")
    wide = AgentInNamespace(agent_ns, tmp_path, WIDE, "0.0.0.0", sock_dir / "wide.sock")
    try:
        deployed.wait_ready()
        wide.wait_ready()
        remote = _send(remote_ns, AGENT_IP, {
            "deployed_udp": ["udp", DEPLOYED["heartbeat"], "remote", REMOTE_DATAGRAMS],
            "deployed_http": ["http", DEPLOYED["heartbeat"], "remote", 1],
            "deployed_metrics_post": ["http", DEPLOYED["metrics"], "remote", 1],
            "wide_udp": ["udp-send", WIDE["heartbeat"], "remote", REMOTE_DATAGRAMS],
            "wide_http": ["http", WIDE["heartbeat"], "remote", 1],
            "wide_metrics_post": ["http", WIDE["metrics"], "remote", 1],
            "scrape": ["metrics", DEPLOYED["metrics"], "", 0],
        })
        # Deployed: the heartbeat port is not there for another host at all; /metrics is, and it
        # refuses a heartbeat with 403.
        assert remote["deployed_udp"] == "refused"
        assert remote["deployed_http"] == ["oserror", "URLError"]
        status, body = remote["deployed_metrics_post"]
        assert status == 403 and body["error"] == "metrics_listener"
        assert "vigil_agent_heartbeats_rejected_total" in str(remote["scrape"])  # /metrics is remote-scrapable
        # Misconfigured wide listener: the datagrams arrive, and the peer check refuses them.
        assert remote["wide_udp"] == "sent"
        assert remote["wide_http"][0] == 403 and remote["wide_http"][1]["error"] == "not_local"
        assert remote["wide_metrics_post"][0] == 403

        for name, agent, ports in (("deployed", deployed, DEPLOYED), ("wide", wide, WIDE)):
            sock = str(sock_dir / f"{name}.sock")
            local = _send(agent_ns, "127.0.0.1", {
                "udp": ["udp-send", ports["heartbeat"], "local-ok", LOCAL["udp"]],
                "http": ["http", ports["heartbeat"], "local-ok", 1],
                "unix": ["unix", sock, "local-ok", LOCAL["unix"]],
            })
            assert local["http"] == [202, {"status": "accepted"}], (name, local, "".join(agent.lines))
            assert local["udp"] == "sent" and local["unix"] == "sent"

        unverified = float(LOCAL["udp"] + LOCAL["http"])
        want = f'vigil_training_heartbeats_received_total{{job="unverified/local-ok",rank="0"}} {unverified}'
        from_unix = (f'vigil_training_heartbeats_received_total{{job="uid/{os.getuid()}/local-ok",rank="0"}} '
                     f'{float(LOCAL["unix"])}')
        done = _run("ip", "netns", "exec", agent_ns, sys.executable, "-c", WAIT_METRICS, json.dumps([want, from_unix]),
                    str(DEPLOYED["metrics"]), str(WIDE["metrics"]), timeout=60)
        assert done.returncode == 0, done.stderr
        deployed_text, wide_text = done.stdout.split("\n#####\n")
        for text in (deployed_text, wide_text):
            assert want in text and from_unix in text  # every local heartbeat: UDP, HTTP and the Unix socket
            assert "remote" not in "".join(line for line in text.splitlines() if 'job="' in line)  # no remote one
            assert _value(text, 'vigil_agent_heartbeats_rejected_total{reason="metrics_listener"}') == 1.0
        # The kernel refused the deployed agent's remote traffic: nothing reached it to count.
        assert _value(deployed_text, 'vigil_agent_heartbeats_rejected_total{reason="not_local"}') == 0.0
        # The wide agent saw every remote datagram and connection, and refused and counted each.
        assert _value(wide_text, 'vigil_agent_heartbeats_rejected_total{reason="not_local"}') == REMOTE_DATAGRAMS + 1
        assert any("not_local" in line and AGENT_IP not in line and REMOTE_IP in line for line in wide.lines)
    finally:
        deployed.stop()
        wide.stop()

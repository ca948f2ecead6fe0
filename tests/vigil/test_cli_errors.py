"""The errors a person sees from the command line: one clear line, no traceback (issue 17).

Listen addresses take ``HOST:PORT`` or ``:PORT`` everywhere; anything else is one error naming the
key. A port already taken names the address and the key. A typo in a config key names the key path
and suggests the closest known key.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.loopback import free_port
from vigil.agent.config import parse_config as parse_agent
from vigil.aggregator.config import parse_config as parse_aggregator
from vigil.contract.validation import ConfigError


def _vigil(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vigil", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("given, expected", [
    (":9411", "0.0.0.0:9411"), ("127.0.0.1:9411", "127.0.0.1:9411"), ("[::1]:9411", "[::1]:9411"),
    ("node7.cluster:9411", "node7.cluster:9411"),
])
def test_host_port_and_port_only_are_accepted_everywhere(given: str, expected: str) -> None:
    assert parse_agent({"listen": given}).listen == expected
    assert parse_agent({"collectors": {"training": {"udp_listen": given}}}).collectors.training.udp_listen == expected
    assert parse_aggregator({"listen": given}).listen == expected


@pytest.mark.parametrize("bad", ["9411", "localhost", "host:port", "1.2.3.4:70000", "[::1:9411"])
def test_a_bad_listen_address_is_one_error_naming_the_key(bad: str) -> None:
    with pytest.raises(ConfigError, match=r"listen: expected HOST:PORT or :PORT"):
        parse_agent({"listen": bad})
    with pytest.raises(ConfigError, match=r"listen: expected HOST:PORT or :PORT"):
        parse_aggregator({"listen": bad})


def test_agent_listen_without_host_exits_2_without_traceback(tmp_path: Path) -> None:
    result = _vigil("agent", "--backend", "fake", "--listen", "9411", cwd=tmp_path)
    assert result.returncode == 2
    assert "listen: expected HOST:PORT or :PORT" in result.stderr and "Traceback" not in result.stderr


def test_aggregator_listen_without_host_exits_2_without_traceback(tmp_path: Path) -> None:
    result = _vigil("aggregator", "--listen", "9500", "--store", str(tmp_path / "s.sqlite"), cwd=tmp_path)
    assert result.returncode == 2
    assert "listen: expected HOST:PORT or :PORT" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("command", ["agent", "aggregator"])
def test_address_in_use_names_the_address(tmp_path: Path, command: str) -> None:
    port = free_port()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        extra = ["--backend", "fake"] if command == "agent" else ["--store", str(tmp_path / "s.sqlite")]
        result = _vigil(command, "--listen", f"127.0.0.1:{port}", *extra, cwd=tmp_path)
    assert result.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port} (listen)" in result.stderr
    assert "in use" in result.stderr and "Traceback" not in result.stderr


def test_a_typo_names_the_path_and_the_closest_key() -> None:
    with pytest.raises(ConfigError) as agent_err:
        parse_agent({"collectors": {"gpu": {"interval_secnds": 1}}, "aggregator": {"tokenfile": "x"}})
    assert "collectors.gpu.interval_secnds: unknown key (did you mean 'interval_seconds'?)" in str(agent_err.value)
    assert "aggregator.tokenfile: unknown key (did you mean 'token_file'?)" in str(agent_err.value)
    with pytest.raises(ConfigError) as agg_err:
        parse_aggregator({"detectors": {"straggler": {"z_treshold": 3}}, "zzz": 1})
    message = str(agg_err.value)
    assert "detectors.straggler.z_treshold: unknown key (did you mean" in message
    assert "zzz: unknown key\n" in message + "\n"  # nothing close: no guess

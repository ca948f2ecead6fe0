"""``vigil token master-key`` / ``node-key``: the node-action key files (mode 0600, never
overwritten), and a node key that verifies what the aggregator signs for that node only."""

from __future__ import annotations

import stat

from vigil.aggregator.outbox import read_key_file
from vigil.cli import main
from vigil.contract.node_actions import node_key, sign, signature_ok
from vigil.contract.wire import NodeActionRequest


def test_master_and_node_key_files(tmp_path, capsys) -> None:
    master, node = tmp_path / "master.key", tmp_path / "gpu-1.key"
    assert main(["token", "master-key", "--out", str(master)]) == 0
    assert main(["token", "node-key", "--master", str(master), "--node", "gpu-1", "--out", str(node)]) == 0
    for path in (master, node):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    key = bytes.fromhex(node.read_text().strip())
    assert len(key) == 32 and key == node_key(read_key_file(master), "gpu-1")
    request = sign(NodeActionRequest(id="d1", action="reset_gpu", node="gpu-1", boot_id="b", gpu=0, gpu_uuid="G",
                                     issued_at=1.0, expires_at=2.0), node_key(read_key_file(master), "gpu-1"))
    assert signature_ok(request, key)
    assert not signature_ok(request, node_key(read_key_file(master), "gpu-2"))
    before = master.read_text()
    assert main(["token", "master-key", "--out", str(master)]) == 2  # never overwritten
    assert master.read_text() == before and "not overwritten" in capsys.readouterr().err


def test_node_key_refuses_a_bad_name_or_master(tmp_path, capsys) -> None:
    master = tmp_path / "master.key"
    master.write_text("abcd\n")
    assert main(["token", "node-key", "--master", str(master), "--node", "gpu-1", "--out", str(tmp_path / "k")]) == 2
    assert "at least 32" in capsys.readouterr().err
    assert main(["token", "master-key", "--out", str(tmp_path / "m2")]) == 0
    assert main(["token", "node-key", "--master", str(tmp_path / "m2"), "--node", "vnode[1-5]",
                 "--out", str(tmp_path / "k")]) == 2
    assert not (tmp_path / "k").exists()

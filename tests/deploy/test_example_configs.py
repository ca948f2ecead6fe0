"""The shipped example configs start after only the documented token step (issue 17).

Runs the token step exactly as deploy/slurm/README.md documents it (the shell block under
"Create the token"), relocated into a temporary root: ``sudo`` dropped, ``/etc/vigil`` and
``/var/lib`` moved under the root, the ``vigil`` group replaced by the caller's. The configs are
copied with the same path substitution and nothing else changed; ``--check`` must fail before the
token step (naming the key) and pass after it.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GUIDE = REPO / "deploy" / "slurm" / "README.md"


def _relocate(text: str, root: Path) -> str:
    return (text.replace("/etc/vigil", f"{root}/etc/vigil").replace("/var/lib/", f"{root}/var/lib/")
            .replace("/opt/vigil/bin/vigil", f"{sys.executable} -m vigil"))


def _token_step(root: Path) -> None:
    guide = GUIDE.read_text()
    section = guide[guide.index("### 2. Create the token"):]
    block = re.search(r"```sh\n(.*?)```", section, re.S)
    assert block is not None, "the token step's shell block is missing from deploy/slurm/README.md"
    script = _relocate(block.group(1), root).replace("sudo ", "").replace("-g vigil ", "")
    script = script.replace("chgrp vigil", 'chgrp "$(id -gn)"')
    subprocess.run(["sh", "-euc", script], check=True, timeout=30)


def _check(command: str, config: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vigil", command, "--config", str(config), "--check"],
                          cwd=cwd, capture_output=True, text=True, timeout=60)


def test_shipped_configs_start_after_the_documented_token_step(tmp_path: Path) -> None:
    (tmp_path / "var" / "lib").mkdir(parents=True)
    configs = {}
    for command in ("agent", "aggregator"):
        shipped = (REPO / "deploy" / "config" / f"{command}.yml").read_text()
        configs[command] = tmp_path / f"{command}.yml"
        configs[command].write_text(_relocate(shipped, tmp_path))

    before = {c: _check(c, p, tmp_path) for c, p in configs.items()}
    assert before["agent"].returncode == 2 and "aggregator.token_file: cannot read" in before["agent"].stdout
    assert before["aggregator"].returncode == 2 and "auth.site_secret_file: cannot read" in before["aggregator"].stdout

    _token_step(tmp_path)
    token = (tmp_path / "etc" / "vigil" / "token")
    assert len(token.read_text().strip()) >= 40 and token.stat().st_mode & 0o007 == 0  # not world-readable

    for command, path in configs.items():
        result = _check(command, path, tmp_path)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "config OK" in result.stdout


def test_check_names_a_typo_and_its_closest_key(tmp_path: Path) -> None:
    config = tmp_path / "agent.yml"
    config.write_text("listen: ':19400'\naggregator: {intervall_seconds: 2}\n")
    result = _check("agent", config, tmp_path)
    assert result.returncode == 2
    assert "aggregator.intervall_seconds: unknown key (did you mean 'interval_seconds'?)" in result.stderr

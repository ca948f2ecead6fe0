"""A real PostgreSQL server from Debian's packages, on loopback, for the store and HA tests.

``PostgresServer`` runs ``initdb`` and ``postgres`` as the ``postgres`` user (the server refuses
to run as root) in a temporary directory that user owns, listening on 127.0.0.1 on a free port
with its unix socket in that directory; it is bounded in time, stopped by pid, and can be
restarted under its clients (``pg_ctl restart -m fast``). ``skip_reason()`` says why a test
cannot have one (not root, not installed, no psycopg).
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from tests.loopback import free_port

START_TIMEOUT_SECONDS = 30.0
USER = "postgres"
PASSWORD = "vigil-test-password"


def bin_dir() -> Path | None:
    """The newest installed server's bin directory (never the /usr/local/bin symlinks)."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    return Path(found[-1]).parent if found else None


def skip_reason() -> str | None:
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "psycopg is not installed (pip install -e '.[postgres]')"
    if bin_dir() is None:
        return "PostgreSQL is not installed (Debian package postgresql; scripts/ensure-system-packages.sh)"
    if os.geteuid() != 0:
        return "starting PostgreSQL as its own user needs root"
    try:
        pwd.getpwnam(USER)
    except KeyError:
        return f"no {USER} user (Debian package postgresql creates it)"
    return None


class PostgresServer:
    """One cluster with a database ``vigil`` and a password role ``vigil`` owning it."""

    def __init__(self) -> None:
        bindir = bin_dir()
        assert bindir is not None, skip_reason()
        self.bin = bindir
        self.port = free_port()
        self.root = Path(tempfile.mkdtemp(prefix="vigil-pg-"))
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        entry = pwd.getpwnam(USER)
        os.chown(self.root, entry.pw_uid, entry.pw_gid)
        self.root.chmod(0o700)
        self.dsn = (f"host=127.0.0.1 port={self.port} dbname=vigil user=vigil password={PASSWORD} "
                    "connect_timeout=3")
        self._as_postgres([str(self.bin / "initdb"), "-D", str(self.data), "-A", "trust", "-U", USER,
                           "--no-sync", "-E", "UTF8"], timeout=60)
        (self.data / "postgresql.auto.conf").write_text(
            f"listen_addresses = '127.0.0.1'\nport = {self.port}\nunix_socket_directories = '{self.root}'\n"
            "fsync = off\nmax_connections = 40\nshared_buffers = 16MB\n")
        self.start()
        self.psql(f"CREATE ROLE vigil LOGIN PASSWORD '{PASSWORD}'")
        self.psql("CREATE DATABASE vigil OWNER vigil")

    def _as_postgres(self, argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["runuser", "-u", USER, "--", *argv], check=True, capture_output=True, text=True,
                              timeout=timeout, cwd=self.root)

    def psql(self, sql: str, dbname: str = "postgres") -> str:
        out = self._as_postgres([str(self.bin / "psql"), "-h", str(self.root), "-p", str(self.port), "-U", USER,
                                 "-d", dbname, "-v", "ON_ERROR_STOP=1", "-At", "-c", sql], timeout=30)
        return out.stdout

    def pid(self) -> int | None:
        try:
            return int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def start(self) -> None:
        self._as_postgres([str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-w",
                           "-t", str(int(START_TIMEOUT_SECONDS)), "start"], timeout=START_TIMEOUT_SECONDS + 10)

    def restart(self) -> None:
        """``pg_ctl restart -m fast``: every client session is cut, then the server is back."""
        self._as_postgres([str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-w",
                           "-t", str(int(START_TIMEOUT_SECONDS)), "-m", "fast", "restart"],
                          timeout=START_TIMEOUT_SECONDS + 10)

    def stop(self) -> None:
        """Fast shutdown by pid (SIGINT), bounded; SIGKILL if it lingers. Removes the directory."""
        pid = self.pid()
        if pid is not None:
            try:
                os.kill(pid, signal.SIGINT)
                deadline = time.monotonic() + 15
                while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
                    time.sleep(0.05)
                if Path(f"/proc/{pid}").exists():
                    os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.root, ignore_errors=True)

    def reset_database(self) -> None:
        """A fresh, empty ``vigil`` database (each test starts from nothing)."""
        self.psql("DROP DATABASE IF EXISTS vigil WITH (FORCE)")
        self.psql("CREATE DATABASE vigil OWNER vigil")

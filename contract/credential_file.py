"""Credential files: created private, checked for exposure, and re-read when they are replaced.

``create_private`` writes a new file with mode 0600 (never over an existing file or through a
link) for ``vigil token ... --out``; ``exposure`` says whether users other than the file's owner
and group may read it, or its group may change it (the aggregator refuses such a file at start,
the agent warns and exports it: agent/credential_exposure.py); ``TokenFile`` re-reads a
bearer token whenever its file is replaced (kubelet rotates a projected service-account token
before it expires). It decides nothing about what a credential is worth.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

log = logging.getLogger("vigil.credentials")

# Bits that expose a credential: any access by "other" users (anyone with a login on the host),
# or write access by the group (a member could swap in a token of their own). Group read is
# how a root-owned file is shared with the service's own group (root:vigil 0640 on systemd,
# fsGroup on Kubernetes, whose Secret volumes are 0440 at least), so it is allowed, as OpenSSH
# allows a root-owned group-readable host key.
EXPOSING_BITS = stat.S_IRWXO | stat.S_IWGRP

def exposure(path: str | Path) -> str | None:
    """Why ``path`` (followed through links, as it is read) is exposed, or None. A file that cannot
    be stat'ed is not judged here: reading it reports that."""
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return None
    if not mode & EXPOSING_BITS:
        return None
    who = "readable or writable by other users" if mode & stat.S_IRWXO else "writable by its group"
    return f"{path} is {who} (mode {mode:04o}); chmod 600 it (or 640 with the service's group)"


def create_private(path: str | Path, text: str) -> str | None:
    """Create ``path`` with mode 0600 holding ``text``; never an existing file, never through a
    symbolic link. Returns why not, or None."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return f"{path} exists; not overwritten (remove it first if you mean to replace it)"
    except OSError as exc:
        return f"cannot create {path}: {exc.strerror or exc}"
    with os.fdopen(fd, "w") as out:
        os.fchmod(out.fileno(), 0o600)  # whatever the umask left
        out.write(text)
    return None


class TokenFile:
    """A bearer token read from a file, and read again whenever the file is replaced or changed
    (its inode, size or mtime differ): kubelet swaps a projected token's file before the token
    expires. Unreadable after start: the last token read is kept, and that is logged once."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._seen: tuple[int, int, int] | None = None
        self._token: str | None = None
        self._failing = False
        st = os.stat(self.path)  # unreadable at start: the caller's start-up error, as before
        self._load(st)

    def _load(self, st: os.stat_result) -> None:
        self._token = self.path.read_text().strip() or None
        self._seen = (st.st_ino, st.st_size, st.st_mtime_ns)

    def current(self) -> str | None:
        """The token to send now (None: the file is empty)."""
        try:
            st = os.stat(self.path)
            if (st.st_ino, st.st_size, st.st_mtime_ns) != self._seen:
                self._load(st)
                log.info("token file %s re-read", self.path)
            self._failing = False
        except OSError as exc:
            if not self._failing:
                log.warning("cannot re-read token file %s (%s): sending the token read before",
                            self.path, exc.strerror or exc)
            self._failing = True
        return self._token

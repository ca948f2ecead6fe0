"""The aggregator's start-up checks, in one list that ``serve`` (it refuses to start on any) and
``vigil aggregator --check`` (it prints them, exit 2) both run, so the two cannot drift.

It reads the files the configuration names as the running user (credentials, TLS pair, node-action
key, PostgreSQL DSN), imports the optional packages the configured parts need (through
``import_module``, a test's boundary), builds the enabled actuators as the service does and
connects once to PostgreSQL where that is the store. It returns one ``key.path: why`` line per
problem; it creates no file, binds no port and sends nothing to an actuator's target (their reach
is checked after the listener opens and never stops the start: app.check_actuators).
"""

from __future__ import annotations

import importlib
import os
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vigil.aggregator.actuators import build_actuators
from vigil.aggregator.auth import Credentials
from vigil.aggregator.config import AggregatorConfig
from vigil.aggregator.listener import tls_context
from vigil.aggregator.outbox import followed, read_key_file
from vigil.aggregator.store import PG_ERRORS, StoreError, pg_connect, read_dsn
from vigil.contract.validation import ConfigError

ImportModule = Callable[[str], Any]
Connect = Callable[[str], Any]

# The optional packages a configured part imports at start, and the extra that installs each
# (pyproject.toml [project.optional-dependencies]).
_KUBERNETES = ("kubernetes", "k8s")
_POSTGRES = ("psycopg", "postgres")


def needed_modules(config: AggregatorConfig) -> list[tuple[str, str, str]]:
    """(config key, module, extra) for each optional package this configuration imports at start."""
    needed = []
    if config.actuators.enabled and config.actuators.kubernetes.enabled:
        needed.append(("actuators.kubernetes", *_KUBERNETES))
    if config.store.backend == "postgresql":
        needed.append(("store.backend", *_POSTGRES))
    return needed


def check_startable(config: AggregatorConfig, credentials: Credentials) -> None:
    """ConfigError (one line, why) when this configuration must not serve."""
    if not config.dry_run and not credentials.any:
        raise ConfigError("dry_run is false but no credentials are configured (auth.site_secret_file, "
                          "auth.alertmanager_token_file, auth.operator_token_file): anyone who can reach "
                          f"{config.listen} could take nodes out; configure them or set dry_run: true")


def ha_timing_problem(config: AggregatorConfig) -> str | None:
    """An HA pair whose leader would look stalled while idle (a round every poll_seconds)."""
    if config.store.backend == "postgresql" and \
            config.actuators.delivery.poll_seconds * 2 > config.ha.progress_timeout_seconds:
        return (f"ha.progress_timeout_seconds ({config.ha.progress_timeout_seconds:g}) must be at least twice "
                f"actuators.delivery.poll_seconds ({config.actuators.delivery.poll_seconds:g}): an idle leader "
                "completes a round every poll")
    return None


def _unreadable(key: str, path: str) -> str | None:
    try:
        with open(path, "rb"):
            return None
    except OSError as exc:
        return (f"{key}: cannot read {path} as uid {os.geteuid()}: {exc.strerror or exc} (the service's user must "
                "read it: chgrp it to the service's group and chmod 0640, deploy/slurm/README.md step 2)")


def tls_problems(config: AggregatorConfig) -> list[str]:
    """The certificate and key are readable by this user and make a pair (listener.tls_context)."""
    cert, key = config.tls.cert_file, config.tls.key_file
    if not (cert and key):
        return []
    unreadable = [p for p in (_unreadable("tls.cert_file", cert), _unreadable("tls.key_file", key)) if p]
    if unreadable:
        return unreadable
    try:
        tls_context(cert, key)
    except (ssl.SSLError, OSError) as exc:
        return [f"tls: cannot load {cert} with {key}: {exc}"]
    return []


def store_problems(config: AggregatorConfig, import_module: ImportModule, connect: Connect) -> list[str]:
    """PostgreSQL: the DSN file reads and one connection opens (the store connects at start).
    SQLite: the file, or the directory it is created in, is writable by this user."""
    if config.store.backend == "postgresql":
        assert config.store.dsn_file is not None  # the config's validator insists
        try:
            dsn = read_dsn(config.store.dsn_file)
        except StoreError as exc:
            return [str(exc)]
        try:
            import_module("psycopg")
        except ImportError:
            return []  # reported by needed_modules' check
        try:
            connect(dsn).close()
        except (StoreError, OSError, *PG_ERRORS) as exc:  # type: ignore[misc]
            return [f"store.dsn_file: cannot connect to PostgreSQL: {' '.join(str(exc).split())}"]
        return []
    path = Path(config.store_path)
    if str(path) == ":memory:":
        return []
    parent = path.resolve().parent
    if path.exists():  # SQLite writes its journal beside the file
        return [] if os.access(path, os.W_OK) and os.access(parent, os.W_OK) else \
            [f"store_path: {path} or its directory is not writable by uid {os.geteuid()}"]
    # systemd's StateDirectory= creates the directory for the service: a missing one whose own
    # parent exists is fine.
    if parent.is_dir():
        return [] if os.access(parent, os.W_OK) else \
            [f"store_path: {path} cannot be created: {parent} is not writable by uid {os.geteuid()}"]
    return [] if parent.parent.is_dir() else [f"store_path: {path}: neither {parent} nor its parent exists"]


def startup_problems(config: AggregatorConfig, *, import_module: ImportModule = importlib.import_module,
                     connect: Connect = pg_connect) -> list[str]:
    """Every reason this configuration cannot serve, one line each (empty: it can)."""
    problems: list[str] = []
    missing = False
    for key, module, extra in needed_modules(config):
        try:
            import_module(module)
        except ImportError as exc:
            missing = True
            problems.append(f"{key}: needs the {module} package, which cannot be imported ({exc}): "
                            f"pip install 'vigil-fleet[{extra}]'")
    try:
        credentials = Credentials.load(config.auth)
    except ConfigError as exc:
        problems.append(str(exc))
    else:
        try:
            check_startable(config, credentials)
        except ConfigError as exc:
            problems.append(str(exc))
    problems.extend(tls_problems(config))
    key_file = config.node_actions.key_file
    if key_file and followed(config):  # the master key is read at start only where a node action follows a delivery
        try:
            read_key_file(key_file)
        except ConfigError as exc:
            problems.append(f"node_actions.key_file: {exc} (create it: vigil token master-key --out FILE)")
    if (ha := ha_timing_problem(config)) is not None:
        problems.append(ha)
    if not missing:  # building an actuator imports its package
        try:
            actuators = build_actuators(config.actuators)
        except (ValueError, ConfigError) as exc:
            problems.append(str(exc))
        except Exception as exc:  # noqa: BLE001 - a client library's own type (kubernetes: no kubeconfig)
            problems.append(f"actuators: {type(exc).__name__}: {exc}")
        else:
            for actuator in actuators.values():
                actuator.close()
    problems.extend(store_problems(config, import_module, connect))
    return problems

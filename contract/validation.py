"""How a configuration or scenario that fails validation is reported: one line per error, each
naming its key path and, for a typo, the closest known key (``collectors.gpu.interval_secnds:
unknown key (did you mean 'interval_seconds'?)``); the one parser of listen addresses (``HOST:PORT``,
``[V6]:PORT``, ``:PORT``); the strict base of every config model, the model of sections derived
from a registry, and the one reader of YAML config files. It imports nothing of ours, so anything
(agent, aggregator, simulator) may use it.
"""

from __future__ import annotations

import difflib
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, TypeVar

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, create_model


class StrictModel(BaseModel):
    """Base of every config model (agent, aggregator, scenarios): unknown keys are errors, so a
    typo names its key path; frozen, so a loaded config is not changed behind its owner's back."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class MutableStrictModel(BaseModel):
    """StrictModel for a value its one owner updates in place (a Decision as the gate and the
    ledger fill it in): unknown keys are errors, fields may be assigned."""

    model_config = ConfigDict(extra="forbid")


_S = TypeVar("_S", bound=StrictModel)


class Sections(StrictModel):
    """Base of a model derived from a registry (``sections_model``): one section per entry."""

    def section(self, name: str, model: type[_S]) -> _S:
        """Section ``name`` as ``model``: how a module reads its own section with its type."""
        value = getattr(self, name)
        if not isinstance(value, model):
            raise TypeError(f"section {name} is a {type(value).__name__}, not a {model.__name__}")
        return value


def sections_model(name: str, module: str,
                   sections: Mapping[str, tuple[type[StrictModel], str | None]]) -> type[Sections]:
    """A strict model with one field per registry entry, in registry order: key -> (the entry's
    config model, its one-line description, shown as the configuration reference's Notes). Each
    section defaults to its model's defaults, as a hand-written ``key: Model = Model()`` would."""
    fields: dict[str, Any] = {key: (model, Field(default=model(), description=description))
                              for key, (model, description) in sections.items()}
    return create_model(name, __base__=Sections, __module__=module, **fields)


# `:PORT` listens on every IPv4 interface, as in Go's and Prometheus's flags.
ALL_INTERFACES = "0.0.0.0"


def split_host_port(value: str) -> tuple[str, int]:
    """``HOST:PORT``, ``[V6]:PORT`` or ``:PORT`` as (host, port); a ValueError saying what is expected
    otherwise. Port 0 asks the kernel for a free port (tests)."""
    host, sep, port = value.strip().rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535 or host.startswith("[") != host.endswith("]"):
        raise ValueError("expected HOST:PORT or :PORT (e.g. 127.0.0.1:9411 or :9411)")
    return host.strip("[]") or ALL_INTERFACES, int(port)


def _canonical_host_port(value: str) -> str:
    host, port = split_host_port(value)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# A listen address in a config model: validated, and `:PORT` spelled out as `0.0.0.0:PORT`.
HostPort = Annotated[str, AfterValidator(_canonical_host_port)]


def _section(annotation: Any) -> type[BaseModel] | None:
    """The model a field's annotation holds (``X``, ``X | None``, ``list[X]``, ``dict[str, X]``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        if arg is not annotation:
            found = _section(arg)
            if found is not None:
                return found
    return None


def closest_key(model: type[BaseModel] | None, loc: tuple[Any, ...]) -> str | None:
    """The known key closest to the unknown last element of ``loc`` (difflib), walking ``model``
    along the rest of the path; None when nothing is close or the path leaves the models."""
    section: type[BaseModel] | None = model
    for part in loc[:-1]:
        if section is None:
            return None
        if not isinstance(part, str):
            continue  # a list index: stay on the item's model
        if part not in section.model_fields:
            return None  # a mapping key or a union's tag: no guess rather than a wrong one
        section = _section(section.model_fields[part].annotation)
    if section is None or not isinstance(loc[-1], str):
        return None
    known = [*section.model_fields, *(f.alias for f in section.model_fields.values() if f.alias)]
    matches = difflib.get_close_matches(loc[-1], known, n=1, cutoff=0.6)
    return matches[0] if matches else None


def format_validation_error(exc: ValidationError, header: str = "invalid configuration",
                            model: type[BaseModel] | None = None) -> str:
    """One line per error, each naming its key path: how every config and scenario error reads.
    With ``model``, an unknown key names the closest known one."""
    lines = []
    for err in exc.errors():
        path = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if not path:  # cross-field checks name their own key path in the message
            lines.append(msg)
        elif err["type"] == "extra_forbidden":
            hint = closest_key(model, tuple(err["loc"]))
            lines.append(f"{path}: unknown key" + (f" (did you mean {hint!r}?)" if hint else ""))
        else:
            got = err.get("input")
            tail = "" if isinstance(got, dict | list) else f" (got {got!r})"
            lines.append(f"{path}: {msg}{tail}")
    return f"{header}:\n  " + "\n  ".join(lines)


_M = TypeVar("_M", bound=BaseModel)


class ConfigError(Exception):
    """A configuration that cannot be used; the message names every offending key path."""


def read_yaml_file(path: str | Path, what: str, error: type[Exception]) -> Any:
    """A YAML file's content, or ``error`` naming ``what`` the file is and why it cannot be read."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise error(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise error(f"{what} {path} is not valid YAML: {exc}") from None


def read_config_file(path: str | Path) -> dict[str, Any]:
    """A YAML config file's top-level mapping (empty file: {}), or a ConfigError saying why not."""
    data = read_yaml_file(path, "config", ConfigError)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"invalid configuration: the top level must be a mapping, got {type(data).__name__}")
    return data


def validate_config(model: type[_M], data: Any) -> _M:
    """``data`` validated as ``model``; errors name every offending key path (agent and aggregator)."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"invalid configuration: the top level must be a mapping, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, model=model)) from None

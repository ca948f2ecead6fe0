"""Metric declarations and observed values: the vocabulary shared by collectors and the exporter.

A collector declares each metric once as a ``MetricSpec`` beside the code that emits it and emits
``Sample``s of it. This module knows nothing about Prometheus' client library or HTTP; the exporter
turns specs and samples into an exposition.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

import msgspec

PREFIX = "vigil_"

# Base units a metric name may end in (Prometheus naming conventions); `_total` follows the unit.
_UNIT_SUFFIXES = ("seconds", "bytes", "celsius", "watts", "joules", "hertz", "ratio", "bytes_per_second")
_NAME_RE = re.compile(r"^vigil_[a-z][a-z0-9_]*$")


class MetricKind(StrEnum):
    COUNTER = "counter"
    GAUGE = "gauge"
    INFO = "info"  # a gauge fixed at 1 whose labels carry an identity; the name ends in `_info`


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """A metric's declaration. ``name`` is the full exposition name (counters include `_total`)."""

    name: str
    kind: MetricKind
    help: str
    labels: tuple[str, ...] = ()
    unit: str = ""

    def __post_init__(self) -> None:
        if not _NAME_RE.match(self.name):
            raise ValueError(f"metric {self.name!r} must be lower_snake_case and start with {PREFIX!r}")
        if self.kind is MetricKind.COUNTER and not self.name.endswith("_total"):
            raise ValueError(f"counter {self.name!r} must end in _total")
        if self.kind is not MetricKind.COUNTER and self.name.endswith("_total"):
            raise ValueError(f"{self.kind} {self.name!r} must not end in _total")
        if self.kind is MetricKind.INFO and not self.name.endswith("_info"):
            raise ValueError(f"info metric {self.name!r} must end in _info")
        if self.unit and self.unit not in _UNIT_SUFFIXES:
            raise ValueError(f"metric {self.name!r}: unit {self.unit!r} is not a base unit")
        if self.unit:
            stem = self.name.removesuffix("_total")
            if not stem.endswith("_" + self.unit):
                raise ValueError(f"metric {self.name!r} must carry its unit {self.unit!r} in its name")
        if len(set(self.labels)) != len(self.labels):
            raise ValueError(f"metric {self.name!r} repeats a label name")


class Sample(msgspec.Struct, frozen=True, gc=False):
    """One observed value. ``labels`` pairs are in the order of the spec's label names.

    A msgspec Struct, not a frozen dataclass: collectors build thousands a second (each GPU's,
    port's and rank's series every cycle), and a frozen dataclass's ``__init__`` sets each field
    through ``object.__setattr__`` (606 ns a sample against 77 ns, issue 47); ``gc=False``: it
    holds only strings, a float and tuples of them."""

    name: str
    value: float
    labels: tuple[tuple[str, str], ...] = ()

    @staticmethod
    def of(spec: MetricSpec, value: float, **labels: object) -> Sample:
        """Build a sample of ``spec``; label values are stringified and must match the spec's names."""
        names = spec.labels
        if len(labels) != len(names):
            raise ValueError(f"{spec.name}: labels {sorted(labels)} != declared {sorted(names)}")
        try:
            pairs = tuple([(k, v if isinstance(v := labels[k], str) else str(v)) for k in names])
        except KeyError:
            raise ValueError(f"{spec.name}: labels {sorted(labels)} != declared {sorted(names)}") from None
        return Sample(spec.name, float(value), pairs)

    def label(self, key: str) -> str | None:
        for k, v in self.labels:
            if k == key:
                return v
        return None

"""Policy groups: which group of nodes a node belongs to, and so which gate mode and budget apply to it.

It reads a node's name, the aggregator-side labels of the config's static map (``gate.node_labels``) and the
labels its own reports assert (``topology`` and the GPU model), and resolves the first group of
``gate.groups`` whose selector matches (docs/gate.md, "Policy groups"). Pure: it decides no verdict and
reads no fleet; the engine hands the gate a ``Membership`` it built with ``GroupResolver``.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from pydantic import Field, model_validator

from vigil.aggregator.fleet import NodeState
from vigil.contract.validation import StrictModel

# What the gate does with a group's decisions: act (deliver), alert (an alert decision instead:
# notifiers informed, nothing drained, reset or rebooted), dry_run (recorded, not delivered).
GroupMode = Literal["act", "alert", "dry_run"]
MODES: tuple[GroupMode, ...] = ("act", "alert", "dry_run")
# The group a node in no configured group is counted under (metrics, /v1/gate); no group may take it.
DEFAULT_GROUP = "default"
# Config-defined, so the `group` label of the metrics stays bounded.
MAX_GROUPS = 32
GROUP_NAME_PATTERN = r"^[a-z][a-z0-9_-]{0,39}$"
# The label a node's GPU model is offered under among its reported labels (NodeConfig.gpu_model,
# nvmlDeviceGetName); it takes precedence over a topology key of the same name.
GPU_MODEL_LABEL = "gpu_model"


def _globs_match(patterns: Iterable[str], value: str) -> bool:
    return any(fnmatch.fnmatchcase(value, p) for p in patterns)


class Selector(StrictModel):
    """Which nodes a group takes; every condition given must hold (an empty selector is refused).

    ``nodes`` and ``labels`` are the aggregator's own: a node's name is bound to its credential and
    ``labels`` come from ``gate.node_labels``. ``reported`` is what the node's reports assert
    (its ``topology`` keys, ``gpu_model``): the node chooses them."""

    nodes: list[str] = Field(default_factory=list, max_length=256)  # fnmatch patterns of node names
    # label -> fnmatch pattern over the value ``gate.node_labels`` gives the node (e.g. partition: gpu-a)
    labels: dict[str, str] = Field(default_factory=dict, max_length=32)
    # label -> fnmatch pattern over the value the node's reports carry (e.g. rack: r1*, gpu_model: "*H200*")
    reported: dict[str, str] = Field(default_factory=dict, max_length=32)

    @model_validator(mode="after")
    def _some(self) -> Selector:
        if not (self.nodes or self.labels or self.reported):
            raise ValueError("a selector needs nodes, labels or reported (nodes: ['*'] takes every node)")
        return self

    def matches(self, node: str, static: Mapping[str, str], reported: Mapping[str, str]) -> bool:
        if self.nodes and not _globs_match(self.nodes, node):
            return False
        for key, pattern in self.labels.items():
            value = static.get(key)
            if value is None or not fnmatch.fnmatchcase(value, pattern):
                return False
        for key, pattern in self.reported.items():
            value = reported.get(key)
            if value is None or not fnmatch.fnmatchcase(value, pattern):
                return False
        return True


class PolicyGroup(StrictModel):
    """One group of ``gate.groups``: its selector, the gate's mode for its nodes and its own breaker budget."""

    name: str = Field(pattern=GROUP_NAME_PATTERN)
    select: Selector
    mode: GroupMode = "act"
    # A selector with ``reported`` conditions lets a node choose its group by what its reports
    # claim: it is refused unless the operator says so here (docs/gate.md, "Which labels to trust").
    trust_reported_labels: bool = False
    # The group's own budget beside the global breaker: most distinct nodes of the group removed within
    # gate.breaker_window_seconds, as a share of the group's nodes that reported within it, and/or
    # absolute; none set: only the global breaker counts. A canary group of 20 with share 0.1 removes 2.
    breaker_max_share: float | None = Field(default=None, gt=0, le=1)
    breaker_max_nodes: int | None = Field(default=None, ge=1)
    # The share's floor, so a small group can act at all (10% of 5 nodes is 0); 1 lets a canary
    # lose one node to a real fault per window.
    breaker_floor_nodes: int = Field(default=1, ge=0)

    @model_validator(mode="after")
    def _trusted(self) -> PolicyGroup:
        if self.name == DEFAULT_GROUP:
            raise ValueError(f"{DEFAULT_GROUP!r} names the nodes in no group; choose another name")
        if self.select.reported and not self.trust_reported_labels:
            raise ValueError(
                f"group {self.name!r} selects by labels the nodes' own reports assert "
                f"({', '.join(sorted(self.select.reported))}): a node can then move itself into or out of it, "
                "and so to a less acting mode or a larger budget. Select by nodes or labels (gate.node_labels: "
                "the partition, a site map), or set trust_reported_labels: true to accept that")
        return self

    @property
    def has_budget(self) -> bool:
        return self.breaker_max_share is not None or self.breaker_max_nodes is not None

    def budget(self, members: int) -> int | None:
        """Most distinct nodes of the group removed within a breaker window, given how many of its
        nodes reported within it; None: the group has no budget of its own."""
        if not self.has_budget:
            return None
        budget = math.inf
        if self.breaker_max_share is not None:
            budget = max(self.breaker_floor_nodes, math.floor(self.breaker_max_share * max(members, 0)))
        if self.breaker_max_nodes is not None:
            budget = min(budget, self.breaker_max_nodes)
        return int(budget)


def check_groups(groups: list[PolicyGroup]) -> None:
    """Raises ValueError for a list of groups the gate cannot use (repeated names)."""
    seen: set[str] = set()
    for g in groups:
        if g.name in seen:
            raise ValueError(f"group {g.name!r} is defined twice (the first match wins: merge them)")
        seen.add(g.name)


def static_labels(node: str, node_labels: Mapping[str, Mapping[str, list[str]]]) -> dict[str, str]:
    """The aggregator-side labels of ``node`` from ``gate.node_labels`` (label -> value -> node
    globs); of several values whose globs match, the first listed."""
    out: dict[str, str] = {}
    for label, values in node_labels.items():
        for value, patterns in values.items():
            if _globs_match(patterns, node):
                out[label] = value
                break
    return out


def reported_labels(node: NodeState) -> dict[str, str]:
    """What ``node``'s own reports assert: its ``topology`` (the agent's config: row, rack,
    leaf_switch...) and its GPU model (its configuration facts, else its first GPU's name)."""
    labels = dict(node.topology)
    model = node.config.gpu_model if node.config is not None else None
    if model is None:
        model = next((g.last.name for g in node.gpus.values() if g.last.name), None)
    if model is not None:
        labels[GPU_MODEL_LABEL] = model
    return labels


def resolve(groups: list[PolicyGroup], node: str, static: Mapping[str, str],
            reported: Mapping[str, str]) -> PolicyGroup | None:
    """The first group, in config order, whose selector matches; None: the gate's default."""
    return next((g for g in groups if g.select.matches(node, static, reported)), None)


@dataclass(frozen=True)
class Membership:
    """Which group each node the fleet knows resolves to (``""``: none, the default), and how many
    of each group's nodes reported within the breaker window: what the gate judges groups by."""

    group_of: Mapping[str, str] = field(default_factory=dict)
    members: Mapping[str, int] = field(default_factory=dict)


class GroupResolver:
    """Resolves nodes to groups, remembering each node's answer until its labels change (a fleet of
    12,500 nodes is resolved each evaluation: only new or relabelled nodes cost a match)."""

    def __init__(self, groups: list[PolicyGroup], node_labels: Mapping[str, Mapping[str, list[str]]]) -> None:
        self.groups = groups
        self.node_labels = node_labels
        self._cache: dict[str, tuple[tuple[tuple[str, str], ...], str]] = {}

    def group_of(self, node: str, reported: Mapping[str, str]) -> str:
        key = tuple(reported.items())  # an agent sends its topology in one order: a reorder only re-resolves
        hit = self._cache.get(node)
        if hit is not None and hit[0] == key:
            return hit[1]
        group = resolve(self.groups, node, static_labels(node, self.node_labels), reported)
        name = group.name if group is not None else ""
        self._cache[node] = (key, name)
        return name

    def membership(self, nodes: Iterable[tuple[str, Mapping[str, str], bool]]) -> Membership:
        """``nodes``: (name, reported labels, whether it reported within the breaker window)."""
        group_of: dict[str, str] = {}
        members = {g.name: 0 for g in self.groups} | {DEFAULT_GROUP: 0}
        for name, reported, recent in nodes:
            g = group_of[name] = self.group_of(name, reported)
            if recent:
                members[g or DEFAULT_GROUP] += 1
        for gone in self._cache.keys() - group_of.keys():
            del self._cache[gone]
        return Membership(group_of, members)

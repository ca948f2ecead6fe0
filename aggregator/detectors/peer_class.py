"""Hardware classes: which nodes are peers for a relative judgement (straggler, GPU peers).

It reads a node's latest GPU states (vendor and model name, maximum SM clock, enforced power
limit) and names its class; nodes of different classes run at different speeds by design (an H100
node in an H200 job is the scheduler's choice, an MI300X is another vendor's GPU, not a fault), so
peer-relative detectors compare a node only with nodes of its own class. It judges nothing;
``HardwareClasses`` is a detector's memo of each node's class, read again only when what names it
changed (fleet change markers).
"""

from __future__ import annotations

from collections import Counter

from vigil.aggregator.fleet import FleetView, NodeState

# Rounding of the continuous parts of a class, so that reading noise does not split a class:
# NVML reports the maximum SM clock in MHz steps of 15 (H100 SXM 1,980 MHz, H200 1,980 MHz, A100
# 1,410 MHz) and power limits in mW; a deliberate cap is at least tens of watts (nvidia-smi -pl).
_CLOCK_STEP_HERTZ = 15e6
_POWER_STEP_WATTS = 25.0

HardwareClass = tuple[str, int | None, int | None]
UNKNOWN: HardwareClass = ("", None, None)


def gpu_model(name: str | None, vendor: str | None) -> str:
    """A GPU's model as its class names it: the library's name, qualified by the vendor where the
    name does not start with it (NVML's "NVIDIA H100 80GB HBM3" and amdsmi's "AMD Instinct MI300X"
    do; an unnamed GPU is "amd" or "nvidia"), so two vendors' GPUs are never one class."""
    model = name or ""
    if vendor and not model.lower().startswith(vendor.lower()):
        model = f"{vendor} {model}".strip()
    return model


def hardware_class(node: NodeState, *, power_limit: bool = True) -> HardwareClass:
    """The node's class: its GPUs' most common (vendor and model, max SM clock, power limit), with
    the clock and the limit rounded. ``power_limit=False`` leaves the limit out (for a detector
    that judges a lowered limit itself). A node that reports no GPU is of the ``UNKNOWN`` class."""
    classes: list[HardwareClass] = []
    for hist in node.gpus.values():
        s = hist.last
        clock = None if s.sm_clock_max_hertz is None else round(s.sm_clock_max_hertz / _CLOCK_STEP_HERTZ)
        limit = None if not power_limit or s.power_limit_watts is None \
            else round(s.power_limit_watts / _POWER_STEP_WATTS)
        classes.append((gpu_model(s.name, s.vendor), clock, limit))
    if not classes:
        return UNKNOWN
    first = classes[0]
    if classes.count(first) == len(classes):
        return first  # the usual node: one class
    # most_common keeps first-seen order among ties: GPU index order, stable across evaluations.
    return Counter(classes).most_common(1)[0][0]


def describe(cls: HardwareClass) -> str:
    """A class for people: ``NVIDIA H100 80GB HBM3, 1980 MHz, 700 W``."""
    name, clock, limit = cls
    parts = [name or "unknown GPU"]
    if clock is not None:
        parts.append(f"{clock * _CLOCK_STEP_HERTZ / 1e6:.0f} MHz")
    if limit is not None:
        parts.append(f"{limit * _POWER_STEP_WATTS:.0f} W")
    return ", ".join(parts)


class HardwareClasses:
    """A detector's memo of ``hardware_class`` per node: what names a node's class changes only
    when a report of it changes a GPU's model, maximum SM clock or power limit, or replaces a GPU
    (``NodeState.gpu_class_revision``; a GPU's vendor changes only with the GPU, whose new uuid
    moves it too; a node that registers again is a new ``NodeState``), so its
    class is read again only then, not once per node per evaluation (``Counter.most_common`` over
    its GPUs, ~5 us a node). ``start`` each evaluation: a view without change markers (built by
    hand) or of another fleet is read afresh."""

    __slots__ = ("_fleet", "_held", "power_limit")

    def __init__(self, *, power_limit: bool = True) -> None:
        self.power_limit = power_limit
        self._fleet: object | None = None
        self._held: dict[str, tuple[NodeState, int, HardwareClass]] = {}

    def start(self, view: FleetView) -> None:
        """Before an evaluation of ``view``: forget what another fleet's (or no fleet's) nodes
        and the nodes gone from the fleet named."""
        fleet = view.fleet if view.revision is not None else None
        if fleet is None or fleet is not self._fleet:
            self._held.clear()
        elif len(self._held) > len(view.nodes):
            self._held = {n: h for n, h in self._held.items() if n in view.nodes}
        self._fleet = fleet

    def of(self, node: NodeState) -> HardwareClass:
        if self._fleet is None:
            return hardware_class(node, power_limit=self.power_limit)
        held = self._held.get(node.name)
        if held is not None and held[0] is node and held[1] == node.gpu_class_revision:
            return held[2]
        cls = hardware_class(node, power_limit=self.power_limit)
        self._held[node.name] = (node, node.gpu_class_revision, cls)
        return cls

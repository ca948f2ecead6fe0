"""Actuators: an explicit table from config section to builder, and the ``actuators`` config.

Each actuator module holds its config model and its ``build``; adding one is a module, a line
in ``REGISTRY`` and a field in ``ActuatorsConfig``. Only enabled actuators are built.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vigil.aggregator.actuators import alertmanager, kubernetes, slurm, webhook
from vigil.aggregator.actuators.actuator import Actuator, ActuatorConfig, DeliveryError, DispatchConfig
from vigil.aggregator.actuators.alertmanager import AlertmanagerConfig
from vigil.aggregator.actuators.kubernetes import KubernetesConfig
from vigil.aggregator.actuators.slurm import SlurmConfig
from vigil.aggregator.actuators.webhook import WebhookConfig

__all__ = ["REGISTRY", "Actuator", "ActuatorsConfig", "DeliveryError", "DispatchConfig", "build_actuators"]


class ActuatorsConfig(ActuatorConfig):
    """``actuators:`` in the aggregator config; each section's ``enabled`` defaults to false."""

    enabled: bool = True
    slurm: SlurmConfig = SlurmConfig()
    kubernetes: KubernetesConfig = KubernetesConfig()
    alertmanager: AlertmanagerConfig = AlertmanagerConfig()
    webhook: WebhookConfig = WebhookConfig()
    delivery: DispatchConfig = DispatchConfig()


# config section -> builder
REGISTRY: dict[str, Callable[[Any], Actuator]] = {
    "slurm": slurm.build,
    "kubernetes": kubernetes.build,
    "alertmanager": alertmanager.build,
    "webhook": webhook.build,
}


def build_actuators(config: ActuatorsConfig) -> dict[str, Actuator]:
    """The enabled actuators by name; a misconfigured one raises ValueError naming its section."""
    built: dict[str, Actuator] = {}
    if not config.enabled:
        return built
    for name, build in REGISTRY.items():
        section = getattr(config, name)
        if section.enabled:
            try:
                built[name] = build(section)
            except (ValueError, OSError) as exc:
                raise ValueError(f"actuators.{name}: {exc}") from exc
    return built

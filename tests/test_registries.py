"""The config sections and the metric catalog are derived from the registries: every detector in
aggregator.detectors.REGISTRY (and the topology attributor) has its section under ``detectors:``,
every collector in agent.collectors.COLLECTORS its section under ``collectors:`` and its metrics in
the catalog; a key no registry entry has is refused; the typed view mypy reads matches the model."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from pydantic import BaseModel

from vigil.agent import config as agent_config
from vigil.agent.catalog import COLLECTOR_SPECS, agent_specs
from vigil.agent.collectors import COLLECTORS
from vigil.agent.collectors import REGISTRY as COLLECTOR_REGISTRY
from vigil.agent.collectors.pcie import PcieConfig
from vigil.agent.collectors.xid import XidConfig as AgentXidConfig
from vigil.aggregator import config as aggregator_config
from vigil.aggregator.detectors import AFTER_DETECTORS, config_model
from vigil.aggregator.detectors import REGISTRY as DETECTOR_REGISTRY
from vigil.contract.validation import ConfigError

REPO = Path(__file__).resolve().parents[1]


def _typed_view(source: Path, name: str) -> dict[str, str]:
    """field -> annotation (as written) of the class ``name`` declared under ``if TYPE_CHECKING``."""
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for cls in node.body:
                if isinstance(cls, ast.ClassDef) and cls.name == name:
                    return {f.target.id: ast.unparse(f.annotation) for f in cls.body
                            if isinstance(f, ast.AnnAssign) and isinstance(f.target, ast.Name)}
    raise AssertionError(f"no typed view {name} in {source}")


def _section_models(model: type[BaseModel]) -> dict[str, type]:
    return {name: field.annotation for name, field in model.model_fields.items()}  # type: ignore[misc]


def test_every_detector_has_its_section_and_nothing_else_does() -> None:
    sections = _section_models(aggregator_config.DetectorsConfig)
    classes = {**DETECTOR_REGISTRY, **AFTER_DETECTORS}
    assert list(sections) == list(classes)
    for name, cls in classes.items():
        assert sections[name] is config_model(cls), name
        field = aggregator_config.DetectorsConfig.model_fields[name]
        assert field.default == config_model(cls)(), name  # the section's own defaults
        own_doc = config_model(cls).__dict__.get("__doc__")  # the model's own docstring, not a base's
        assert field.description == (" ".join(own_doc.split()) if own_doc else None), name
    assert aggregator_config.DetectorsConfig.model_fields["fabric"].description.startswith("GPUs whose NVLink fabric")
    assert aggregator_config.DetectorsConfig.model_fields["xid"].description is None  # no docstring, no note
    # Built from its section: the engine passes each detector the section of its own name.
    config = aggregator_config.parse_config({})
    for name, cls in DETECTOR_REGISTRY.items():
        assert isinstance(getattr(config.detectors, name), config_model(cls)), name


def test_an_unknown_detector_key_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"detectors\.no_such_detector: unknown key"):
        aggregator_config.parse_config({"detectors": {"no_such_detector": {"enabled": True}}})
    with pytest.raises(ConfigError, match=r"detectors\.gpu_pear: unknown key \(did you mean 'gpu_peer'\?\)"):
        aggregator_config.parse_config({"detectors": {"gpu_pear": {}}})
    # A known section keeps strict validation of its own keys and values.
    with pytest.raises(ConfigError, match=r"detectors\.gpu_peer\.clock_ratio"):
        aggregator_config.parse_config({"detectors": {"gpu_peer": {"clock_ratio": 2}}})
    config = aggregator_config.parse_config({"detectors": {"gpu_peer": {"enabled": False}}})
    assert not config.detectors.gpu_peer.enabled


def test_every_collector_has_its_section_builder_and_metrics() -> None:
    sections = _section_models(agent_config.CollectorsConfig)
    assert list(sections) == list(COLLECTORS) == list(COLLECTOR_REGISTRY) == list(COLLECTOR_SPECS)
    catalog = agent_specs()
    for name, module in COLLECTORS.items():
        assert sections[name] is module.CONFIG, name
        field = agent_config.CollectorsConfig.model_fields[name]
        assert field.default == module.CONFIG() and field.description == getattr(module, "DESCRIPTION", None), name
        assert COLLECTOR_REGISTRY[name] is module.build, name
        assert COLLECTOR_SPECS[name] == tuple(module.SPECS) and module.SPECS, name
        for spec in module.SPECS:
            assert spec in catalog, (name, spec.name)


def test_an_unknown_collector_key_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"collectors\.no_such_collector: unknown key"):
        agent_config.parse_config({"node": "n1", "collectors": {"no_such_collector": {}}})
    with pytest.raises(ConfigError, match=r"collectors\.pcie\.interval_seconds"):
        agent_config.parse_config({"node": "n1", "collectors": {"pcie": {"interval_seconds": 0}}})


def test_a_module_reads_its_own_section_with_its_type() -> None:
    collectors = agent_config.parse_config({"node": "n1", "collectors": {"pcie": {"enabled": False}}}).collectors
    assert collectors.section("pcie", PcieConfig) is collectors.pcie and not collectors.pcie.enabled
    with pytest.raises(TypeError, match="section pcie is a PcieConfig, not a XidConfig"):
        collectors.section("pcie", AgentXidConfig)


@pytest.mark.parametrize(("source", "name", "model"), [
    (REPO / "aggregator" / "config.py", "DetectorsConfig", aggregator_config.DetectorsConfig),
    (REPO / "agent" / "config.py", "CollectorsConfig", agent_config.CollectorsConfig),
])
def test_the_typed_view_matches_the_derived_model(source: Path, name: str, model: type[BaseModel]) -> None:
    view = _typed_view(source, name)
    assert view, name
    sections = _section_models(model)
    for field, annotation in view.items():
        assert field in sections and sections[field].__name__ == annotation, (name, field)


def test_a_class_built_from_no_config_section_is_no_registry_entry() -> None:
    """A detector's section is the model its constructor's ``config`` takes: a class whose
    constructor takes none, or takes something that is not a strict model, is refused by name."""

    class NoConfig:
        def __init__(self) -> None: ...

    class NotAModel:
        def __init__(self, config: dict[str, int]) -> None: ...

    for cls in (NoConfig, NotAModel):
        with pytest.raises(TypeError, match="cannot be a registry entry"):
            config_model(cls)
    assert config_model(DETECTOR_REGISTRY["xid"]).__name__ == "XidConfig"

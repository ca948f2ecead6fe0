from pathlib import Path

import pytest

from vigil.agent.config import load_config, parse_config
from vigil.contract.validation import ConfigError


def test_defaults_are_safe() -> None:
    c = parse_config({})
    assert c.listen.startswith("127.0.0.1:")
    assert c.nvml.backend == "nvml"  # never the fake unless asked for
    assert c.aggregator.url is None


@pytest.mark.parametrize(
    ("data", "path"),
    [
        ({"listne": "x"}, "listne: unknown key"),
        ({"collectors": {"host": {"intervl_seconds": 1}}}, "collectors.host.intervl_seconds: unknown key"),
        ({"collectors": {"host": {"interval_seconds": "soon"}}}, "collectors.host.interval_seconds"),
        ({"collectors": {"host": {"interval_seconds": -1}}}, "collectors.host.interval_seconds"),
        ({"nvml": {"backend": "nvidia"}}, "nvml.backend"),
        ({"aggregator": {"interval_seconds": 0}}, "aggregator.interval_seconds"),
    ],
)
def test_typos_and_wrong_types_name_the_key_path(data: dict, path: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    assert path in str(err.value)


def test_load_config_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("listen: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    top = tmp_path / "list.yaml"
    top.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(top)
    good = tmp_path / "good.yaml"
    good.write_text("node: gpu-17\ntopology: {rack: r3, leaf_switch: leaf-07}\n")
    c = load_config(good)
    assert c.node == "gpu-17" and c.topology["leaf_switch"] == "leaf-07"


def test_a_node_name_in_loadgens_reserved_namespace_is_refused() -> None:
    """loadgen-* names are vigil loadgen's synthetic nodes, which the aggregator never judges: a
    real agent may not take one. The lookalike, a name that merely starts "loadgen", is a node's."""
    with pytest.raises(ConfigError, match="reserved for vigil loadgen"):
        parse_config({"node": "loadgen-gpu-001"})
    assert parse_config({"node": "loadgenerator-1"}).node == "loadgenerator-1"

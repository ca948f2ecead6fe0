import pytest

from vigil.aggregator.config import AggregatorConfig, ConfigError, load_config, parse_config


def test_defaults_are_safe():
    cfg = load_config(None)
    assert cfg.listen == "127.0.0.1:9500" and cfg.host == "127.0.0.1" and cfg.port == 9500
    assert cfg.dry_run is True and cfg.auth.site_secret_file is None and not cfg.tls.enabled
    assert not cfg.store_path.startswith("/")


def test_unknown_key_is_named_by_its_path():
    with pytest.raises(ConfigError, match=r"detectors\.straggler\.z_treshold: unknown key"):
        parse_config({"detectors": {"straggler": {"z_treshold": 3}}})


def test_bad_value_is_named():
    with pytest.raises(ConfigError, match="listen"):
        parse_config({"listen": "nowhere"})
    with pytest.raises(ConfigError, match=r"detectors\.memory\.uncorrectable_action"):
        parse_config({"detectors": {"memory": {"uncorrectable_action": "explode"}}})


def test_yaml_file(tmp_path):
    path = tmp_path / "agg.yaml"
    path.write_text("listen: 127.0.0.1:9600\ndetectors:\n  hang:\n    stall_seconds: 90\n")
    cfg = load_config(path)
    assert cfg.port == 9600 and cfg.detectors.hang.stall_seconds == 90
    path.write_text("listen: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    assert isinstance(parse_config(None), AggregatorConfig)

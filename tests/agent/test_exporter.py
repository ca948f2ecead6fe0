from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from vigil.agent.exporter import SnapshotExporter, render
from vigil.agent.metric import MetricKind, MetricSpec, Sample

TEMP = MetricSpec("vigil_gpu_temperature_celsius", MetricKind.GAUGE, 'GPU "core" temperature\\ and more.\nline',
                  labels=("gpu", "uuid"), unit="celsius")
XID = MetricSpec("vigil_gpu_xid_errors_total", MetricKind.COUNTER, "Xid errors.", labels=("gpu", "code"))
INFO = MetricSpec("vigil_gpu_info", MetricKind.INFO, "Identity.", labels=("gpu", "name"))
UP = MetricSpec("vigil_agent_up", MetricKind.GAUGE, "Unlabelled.")
SAMPLES = [
    Sample.of(TEMP, 41.5, gpu=0, uuid='GPU-"quoted"\\back\nslash'),
    Sample.of(TEMP, 1e-7, gpu=1, uuid="GPU-b"),
    Sample.of(TEMP, 12345678901.0, gpu=2, uuid="GPU-c"),
    Sample.of(XID, 3, gpu=0, code=79),
    Sample.of(INFO, 1, gpu=0, name="NVIDIA H100 80GB HBM3"),
    Sample.of(UP, 1),
    Sample("vigil_not_declared", 1.0),
]


def test_direct_encoder_matches_prometheus_client_byte_for_byte() -> None:
    exporter = SnapshotExporter([TEMP, XID, INFO, UP], [lambda: SAMPLES])
    registry = CollectorRegistry(auto_describe=False)
    registry.register(exporter)
    assert exporter.render_text() == generate_latest(registry)
    assert exporter.render_text() == generate_latest(registry)  # and again from the prefix cache


def test_undeclared_samples_are_dropped_and_duplicates_kept_once() -> None:
    dup = [*SAMPLES, Sample.of(XID, 99, gpu=0, code=79)]
    text = render(SnapshotExporter([TEMP, XID, INFO, UP], [lambda: dup])).decode()
    assert "vigil_not_declared" not in text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["vigil_gpu_xid_errors"].type == "counter"
    assert [s.value for s in families["vigil_gpu_xid_errors"].samples] == [3.0]
    temps = {s.labels["gpu"]: s for s in families["vigil_gpu_temperature_celsius"].samples}
    assert temps["0"].labels["uuid"] == 'GPU-"quoted"\\back\nslash' and temps["0"].value == 41.5


def test_a_metric_declared_twice_differently_is_refused() -> None:
    other = MetricSpec("vigil_agent_up", MetricKind.GAUGE, "different help")
    try:
        SnapshotExporter([UP, other], [])
    except ValueError as exc:
        assert "declared twice" in str(exc)
    else:
        raise AssertionError("expected ValueError")


def test_value_formatting_matches_the_library_across_magnitudes() -> None:
    values = [0.0, -0.0, 1.0, -3.5, 1e-9, 123456.0, 1234567.0, 12345678.9, 2.5276063744e10, 1e22,
              float("inf"), float("-inf"), float("nan"), 7.0, 0.1]
    spec = MetricSpec("vigil_agent_probe", MetricKind.GAUGE, "probe", labels=("i",))
    state = {"v": values}
    exporter = SnapshotExporter([spec], [lambda: [Sample.of(spec, v, i=i) for i, v in enumerate(state["v"])]])
    registry = CollectorRegistry(auto_describe=False)
    registry.register(exporter)
    assert exporter.render_text() == generate_latest(registry)
    state["v"] = [v * 3 + 1 for v in values]  # changed values must not come from the line cache
    assert exporter.render_text() == generate_latest(registry)

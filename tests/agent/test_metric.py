import pytest

from vigil.agent.metric import MetricKind, MetricSpec, Sample


def test_counter_needs_total_and_unit_in_name() -> None:
    MetricSpec("vigil_gpu_energy_joules_total", MetricKind.COUNTER, "h", unit="joules")
    with pytest.raises(ValueError, match="_total"):
        MetricSpec("vigil_gpu_energy_joules", MetricKind.COUNTER, "h", unit="joules")
    with pytest.raises(ValueError, match="unit"):
        MetricSpec("vigil_gpu_power", MetricKind.GAUGE, "h", unit="watts")
    with pytest.raises(ValueError, match="base unit"):
        MetricSpec("vigil_gpu_power_milliwatts", MetricKind.GAUGE, "h", unit="milliwatts")
    with pytest.raises(ValueError, match="_info"):
        MetricSpec("vigil_gpu_identity", MetricKind.INFO, "h")
    with pytest.raises(ValueError, match="start with"):
        MetricSpec("gpu_temp_celsius", MetricKind.GAUGE, "h")


def test_sample_labels_follow_spec_order_and_must_match() -> None:
    spec = MetricSpec("vigil_gpu_temperature_celsius", MetricKind.GAUGE, "h", labels=("gpu", "uuid"),
                      unit="celsius")
    s = Sample.of(spec, 41, uuid="GPU-1", gpu=0)
    assert s.labels == (("gpu", "0"), ("uuid", "GPU-1"))
    assert s.label("uuid") == "GPU-1" and s.value == 41.0
    with pytest.raises(ValueError, match="labels"):
        Sample.of(spec, 1, gpu=0)

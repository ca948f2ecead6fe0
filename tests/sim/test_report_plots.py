"""The report's plots, checked on the figures themselves: each series its own colour and line
style, no line drawn across a gap in the samples (a NaN breaks it) while regular samples stay one
line, marks at one moment in one label, and every label whole inside the saved PNG."""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from vigil.sim.report import GAP_FACTOR, _save, fleet_figure, job_figure, with_gaps
from vigil.sim.run import SimDecision, SimResult, run_scenario
from vigil.sim.scenario import load_scenario, shortened


@pytest.fixture(scope="module")
def result() -> SimResult:
    # the hang: node-0005 stops at 60 s; it is drained and the job restarted at the same moment
    return run_scenario(shortened(load_scenario("hang"), 150))


@pytest.fixture
def close() -> Iterator[list[Any]]:
    import matplotlib.pyplot as plt

    figures: list[Any] = []
    yield figures
    for fig in figures:
        plt.close(fig)


def data_lines(ax: Any) -> list[Any]:
    """The plotted series (the fault and decision marks are two-point vertical lines)."""
    return [line for line in ax.get_lines() if len(line.get_xdata()) > 2]


def test_each_series_has_a_colour_and_style_of_its_own(result: SimResult, close: list[Any]) -> None:
    from matplotlib.colors import to_hex

    fig = job_figure(result, 0)
    close.append(fig)
    lower = data_lines(fig.axes[1])
    assert {line.get_label() for line in lower} >= {"nodes, median", "node-0005"}
    colours = [to_hex(line.get_color()) for line in lower]
    assert len(set(colours)) == len(colours), colours  # node-0005 is not the median's blue
    band = to_hex(fig.axes[1].collections[0].get_facecolor()[0], keep_alpha=False)
    assert band not in {to_hex(line.get_color()) for line in lower if line.get_label().startswith("node-")}
    fleet = fleet_figure(result)
    close.append(fleet)
    styles = [(to_hex(line.get_color()), str(line.get_linestyle())) for line in data_lines(fleet.axes[0])]
    assert len(styles) == 4 and len({c for c, _ in styles}) == 4 and len({s for _, s in styles}) == 4


def test_a_gap_in_the_samples_breaks_the_line_and_regular_samples_do_not(result: SimResult,
                                                                        close: list[Any]) -> None:
    trace = result.jobs[0]
    keep = [i for i in range(len(trace.t)) if not 5 <= i < 10]  # five windows missing: a gap
    gapped = dataclasses.replace(trace, t=[trace.t[i] for i in keep],
                                 step_seconds=[trace.step_seconds[i] for i in keep],
                                 node_compute_seconds=[trace.node_compute_seconds[i] for i in keep])
    fig = job_figure(dataclasses.replace(result, jobs=[gapped]), 0)
    close.append(fig)
    for ax in fig.axes:
        for line in data_lines(ax):
            x, y = np.asarray(line.get_xdata(), float), np.asarray(line.get_ydata(), float)
            gaps = np.flatnonzero(np.isnan(y))
            assert len(gaps) == 1, line.get_label()
            before, after = x[gaps[0] - 1] * 60, x[gaps[0] + 1] * 60
            assert before == pytest.approx(trace.t[4]) and after == pytest.approx(trace.t[10])
    regular = job_figure(result, 0)  # the lookalike: every window there, nothing broken
    close.append(regular)
    assert not any(np.isnan(np.asarray(line.get_ydata(), float)).any()
                   for ax in regular.axes for line in data_lines(ax))
    # jittered sampling within GAP_FACTOR of the usual interval is not a gap
    t = np.cumsum([5.0, 5.0, 5.0 * GAP_FACTOR * 0.99, 5.0, 4.0, 5.0])
    assert len(with_gaps(t, t)[0]) == len(t)
    tt, yy = with_gaps(t, np.ones((len(t), 3)))
    assert len(tt) == len(t) and yy.shape == (len(t), 3)


def png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def test_marks_at_one_moment_share_a_label_and_every_label_is_whole_in_the_png(
        result: SimResult, close: list[Any], tmp_path: Path) -> None:
    from matplotlib.text import Text

    last = result.jobs[0].t[-1]
    late = SimDecision(t=last, ts=last, id="", node="node-0007", action="inspect_hardware", detector="gpu_health",
                       reason="x", admitted=True, verdict="admitted")  # a long label at the right edge
    fig = job_figure(dataclasses.replace(result, decisions=[*result.decisions, late]), 0)
    close.append(fig)
    labels = [t.get_text() for t in fig.axes[1].texts]
    assert "drain node-0005\nrestart_job job pretrain" in labels  # the same moment: stacked, not overdrawn
    path = tmp_path / "job.png"
    _save(fig, path)
    renderer = fig.canvas.get_renderer()
    texts: list[Text] = [t for ax in fig.axes for t in (*ax.texts, ax.title, ax.xaxis.label, ax.yaxis.label,
                                                         *ax.get_legend().get_texts()) if t.get_text().strip()]
    assert any("inspect_hardware node-0007" in t.get_text() for t in texts)
    whole = fig.get_tightbbox(renderer)  # inches: every artist, labels included
    width, height = png_size(path)
    assert width >= whole.width * 90 and height >= whole.height * 90
    for text in texts:
        box = text.get_window_extent(renderer)
        assert whole.x0 * fig.dpi - 1 <= box.x0 and box.x1 <= whole.x1 * fig.dpi + 1, text.get_text()
        assert whole.y0 * fig.dpi - 1 <= box.y0 and box.y1 <= whole.y1 * fig.dpi + 1, text.get_text()

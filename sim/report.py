"""The simulation's report page: ``index.html`` with PNG plots (matplotlib, Agg backend).

Per job: step time over time, each node's compute time (the fleet's spread as a band, nodes with
a fault or a decision as their own lines) with fault and decision marks; and the fleet's state
over time (nodes reporting, silent, with an active fault, removed by a decision). Each series has
a colour and a line style of its own, a line breaks where samples are missing (no line across a
gap), marks at one moment share one label, and the saved file holds every label whole. It reads a
``SimResult`` and its ``Score``; it runs and judges nothing.
"""

from __future__ import annotations

import html
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from vigil.sim.run import SimResult
from vigil.sim.score import Score, summary

_MAX_HIGHLIGHTED = 6  # more individual lines than this make a plot unreadable
# One (colour, line style) per highlighted node: matplotlib's qualitative tab10 palette without the
# colours the job plot reserves (blue: the fleet's band and median, red: faults, green: decisions);
# a line style each as well, so two series differ even to a reader who cannot tell the colours apart.
SERIES_STYLES = (("tab:orange", "-"), ("tab:purple", "--"), ("tab:brown", "-."), ("tab:pink", ":"),
                 ("tab:olive", (0, (5, 1))), ("tab:cyan", (0, (3, 1, 1, 1, 1, 1))), ("tab:gray", (0, (1, 1))))
# The fleet plot's four series.
FLEET_STYLES = (("tab:blue", "-"), ("tab:orange", "--"), ("tab:red", "-."), ("tab:purple", ":"))
# Samples further apart than this many times the usual interval (the median) leave a gap: the line
# breaks there instead of joining the samples on each side (a hung or restarting job has no windows).
GAP_FACTOR = 1.5


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only: never open a window, never need a display
    import matplotlib.pyplot as plt

    return plt


def with_gaps(t: Any, *series: Any) -> tuple[np.ndarray, ...]:
    """``t`` and each series (indexed by sample first) with a NaN sample in each gap (a step over
    GAP_FACTOR times the median step), at the gap's middle: matplotlib breaks a line at a NaN."""
    times = np.asarray(t, dtype=float)
    arrays = [np.asarray(x, dtype=float) for x in series]
    if len(times) < 3:
        return (times, *arrays)
    steps = np.diff(times)
    at = np.flatnonzero(steps > GAP_FACTOR * np.median(steps))
    if not len(at):
        return (times, *arrays)
    middles = (times[at] + times[at + 1]) / 2.0
    return (np.insert(times, at + 1, middles), *(np.insert(a, at + 1, np.nan, axis=0) for a in arrays))


def _marks(ax: Any, marks: dict[float, list[str]], *, color: str, y: float, va: str, ha: str) -> None:
    """One vertical label per moment, its marks one per line (none drawn over another)."""
    for x, labels in marks.items():
        ax.annotate("\n".join(dict.fromkeys(labels)), (x, y), xycoords=("data", "axes fraction"), rotation=90,
                    va=va, ha=ha, fontsize=7, color=color)


def _save(fig: Any, path: Path) -> None:
    """Lay out, then save the whole figure: a label outside the axes is never cut from the file."""
    fig.tight_layout()
    fig.savefig(path, dpi=90, bbox_inches="tight", pad_inches=0.1)


def _job_plot(result: SimResult, index: int, path: Path) -> None:
    plt = _pyplot()
    fig = job_figure(result, index)
    _save(fig, path)
    plt.close(fig)


def job_figure(result: SimResult, index: int) -> Any:
    """The job's figure (matplotlib Figure; the caller saves and closes it)."""
    plt = _pyplot()
    trace = result.jobs[index]
    sc = result.scenario
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True)
    if len(trace.t):
        t, step, comp = with_gaps(np.array(trace.t) / 60.0, trace.step_seconds,
                                  np.vstack(trace.node_compute_seconds))  # comp: (windows, nodes)
        ax1.plot(t, step, color="black", lw=1.0, label="job step time")
        with np.errstate(all="ignore"):
            lo, med, hi = np.percentile(comp, [5, 50, 95], axis=1)
        ax2.fill_between(t, lo, hi, color="tab:blue", alpha=0.25, label="nodes, p5-p95")
        ax2.plot(t, med, color="tab:blue", lw=1.0, label="nodes, median")
        # Worth a line of their own, most telling first: nodes made slow or hung, nodes the
        # training detectors acted on, then other nodes with a fault of their own.
        members = set(trace.nodes)
        first = [n for f in sc.faults if f.kind in ("slow_node", "hang") and (f.node or f.nodes)
                 for n in sc.fault_nodes(f)]
        second = [d.node for d in result.decisions if d.admitted and d.job == trace.name
                  and d.detector in ("straggler", "hang")]
        third = [n for f in sc.faults if f.node or f.nodes for n in sc.fault_nodes(f)]
        marked = list(dict.fromkeys(n for n in (*first, *second, *third) if n in members))[:_MAX_HIGHLIGHTED]
        col = {n: i for i, n in enumerate(trace.nodes)}
        for n, (color, style) in zip(marked, SERIES_STYLES, strict=False):
            ax2.plot(t, comp[:, col[n]], lw=1.2, color=color, ls=style, label=n)
    nodes = set(trace.nodes)
    faults: dict[float, list[str]] = defaultdict(list)
    for f in sc.faults:
        if nodes & set(sc.fault_nodes(f)) or getattr(f, "job", None) == trace.name:
            for ax in (ax1, ax2):
                ax.axvline(f.at_seconds / 60.0, color="tab:red", ls="--", lw=0.9)
            faults[f.at_seconds / 60.0].append(f.kind)
    decisions: dict[float, list[str]] = defaultdict(list)
    for d in result.decisions:
        if d.admitted and (d.node in nodes or d.job == trace.name):
            for ax in (ax1, ax2):
                ax.axvline(d.t / 60.0, color="tab:green", ls=":", lw=0.9)
            subject = d.node or f"job {d.job}"  # a job-level decision names no node
            decisions[d.t / 60.0].append(f"{d.action} {subject}")
    _marks(ax1, faults, color="tab:red", y=0.98, va="top", ha="right")
    _marks(ax2, decisions, color="tab:green", y=0.02, va="bottom", ha="left")
    ax1.set_ylabel("step seconds")
    ax2.set_ylabel("compute seconds")
    ax2.set_xlabel("simulated minutes")
    ax1.set_title(f"job {trace.name}: {len(trace.nodes)} nodes (red: faults, green: decisions)")
    ax1.legend(loc="upper left", fontsize=8)
    ax2.legend(loc="upper left", fontsize=8, ncol=2)
    return fig


def _fleet_plot(result: SimResult, path: Path) -> None:
    plt = _pyplot()
    fig = fleet_figure(result)
    _save(fig, path)
    plt.close(fig)


def fleet_figure(result: SimResult) -> Any:
    """The fleet's figure (matplotlib Figure; the caller saves and closes it)."""
    plt = _pyplot()
    sc = result.scenario
    t = np.array(result.fleet_t)
    faulted = np.zeros(len(t))
    for f in sc.faults:
        end = getattr(f, "until_seconds", None)
        end = np.inf if end is None else end
        faulted += len(sc.fault_nodes(f)) * ((t >= f.at_seconds) & (t < end))
    removed = np.zeros(len(t))
    seen: set[str] = set()
    for d in sorted((d for d in result.decisions if d.admitted and d.action in
                     ("drain", "reset_gpu", "reboot_node", "inspect_hardware")), key=lambda d: d.t):
        if d.node is not None and d.node not in seen:
            seen.add(d.node)
            removed += t >= d.t
    fig, ax = plt.subplots(figsize=(11, 4))
    minutes, *series = with_gaps(t / 60.0, result.fleet_reporting, result.fleet_silent, faulted, removed)
    labels = ("nodes reporting", "nodes silent", "faults active (node count)", "nodes removed by a decision")
    for values, label, (color, style) in zip(series, labels, FLEET_STYLES, strict=True):
        ax.plot(minutes, values, color=color, ls=style, label=label)
    ax.set_xlabel("simulated minutes")
    ax.set_ylabel("nodes")
    ax.set_yscale("symlog")
    ax.set_title(f"fleet of {sc.fleet.nodes} nodes")
    ax.legend(loc="center right", fontsize=8)
    return fig


def write_report(result: SimResult, s: Score, directory: Path) -> Path:
    """Write the page and its plots under ``directory``; returns the index.html path."""
    directory.mkdir(parents=True, exist_ok=True)
    _fleet_plot(result, directory / "fleet.png")
    job_pngs = []
    for i, trace in enumerate(result.jobs):
        name = f"job-{i}.png"
        _job_plot(result, i, directory / name)
        job_pngs.append((trace.name, name))
    data = summary(result, s)
    esc = html.escape
    rows = "".join(
        f"<tr><td>{esc(e['subject'])}</td><td>{esc(', '.join(e['action']))}</td><td>{e['within_seconds']:g}</td>"
        f"<td>{'' if e['fault_at_seconds'] is None else e['fault_at_seconds']}</td>"
        f"<td>{'' if e['latency_seconds'] is None else e['latency_seconds']}</td>"
        f"<td class={'ok' if e['met'] else 'bad'}>{'met' if e['met'] else 'MISSED'}</td></tr>"
        for e in data["expectations"])
    drows = "".join(
        f"<tr><td>{d.t:g}</td><td>{esc(d.node or f'job {d.job}')}</td><td>{esc(d.action)}</td>"
        f"<td>{esc(d.detector)}</td>"
        f"<td>{'admitted' if d.admitted else 'refused: ' + esc(d.verdict)}</td><td>{esc(d.reason)}</td></tr>"
        for d in result.decisions[:500])
    jobs = "".join(f"<h2>job {esc(n)}</h2><img src='{p}' alt='job {esc(n)}'>" for n, p in job_pngs)
    lat = data["detection_latency_seconds"]
    back = "".join(
        f"<tr><td>{esc(a)}</td><td>{r['removed']}</td><td>{r['returned']}</td>"
        f"<td>{'' if r['seconds']['p50'] is None else r['seconds']['p50']}</td>"
        f"<td>{'' if r['seconds']['max'] is None else r['seconds']['max']}</td>"
        f"<td>{r['not_returned']['inspect_hardware']}</td><td>{r['not_returned']['still_out']}</td></tr>"
        for a, r in data["return_to_service"]["by_action"].items())
    verdict = "PASS" if data["pass"] else "FAIL"
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>vigil sim: {esc(result.scenario.name)}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1100px}} td,th{{padding:2px 8px;text-align:left}}
.ok{{color:#080}} .bad{{color:#b00;font-weight:bold}} img{{max-width:100%}}</style></head><body>
<h1>{esc(result.scenario.name)}: <span class={'ok' if data['pass'] else 'bad'}>{verdict}</span></h1>
<p>{esc(result.scenario.description)}</p>
<p>{result.scenario.fleet.nodes} nodes, {data['simulated_seconds']:g} simulated seconds in
{data['wall_seconds']:g} s wall, seed {result.seed}; {data['reports']} reports, {data['heartbeats']} heartbeats.
Precision {data['precision']}, recall {data['recall']}, false drains {data['false_drains']},
detection latency p50 {lat['p50']} s, p95 {lat['p95']} s, max {lat['max']} s;
breaker expected {data['breaker']['expected']}, tripped {data['breaker']['tripped']}.</p>
<h2>expectations</h2><table><tr><th>subject</th><th>action</th><th>within s</th><th>fault at s</th>
<th>latency s</th><th></th></tr>{rows}</table>
<h2>return to service (fault to resume)</h2><table><tr><th>taken out by</th><th>removed</th>
<th>returned</th><th>p50 s</th><th>max s</th><th>to inspection</th><th>still out</th></tr>{back}</table>
<h2>fleet</h2><img src="fleet.png" alt="fleet state over time">
{jobs}
<h2>decisions</h2><table><tr><th>t s</th><th>node</th><th>action</th><th>detector</th><th>gate</th>
<th>reason</th></tr>{drows}</table>
</body></html>
"""
    index = directory / "index.html"
    index.write_text(page)
    return index

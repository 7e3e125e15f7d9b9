"""`stalwart report RUN_DIR`: PNG figures and one HTML page from a finished (or killed) run.

Reads the run (orchestrator/observe/rundir.py), computes the numbers
(orchestrator/observe/analysis.py, orchestrator/observe/rank_times.py), draws the figures
(orchestrator/observe/figures.py, orchestrator/observe/figures_costs.py: matplotlib, imported
only by `build_report`), writes the page and puts it all together (`build_report`) in
RUN_DIR/report/ (or `out_dir`). Nothing here needs Ray or a running job. See docs/report.md for
how to read the figures.
"""

from __future__ import annotations

import html
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stalwart.orchestrator.observe.analysis import (
    Goodput,
    Timeline,
    as_int,
    as_list,
    fmt_secs,
    goodput,
    num,
    timeline,
)
from stalwart.orchestrator.observe.rank_times import heatmap
from stalwart.orchestrator.observe.rundir import ReportError, load_run


@dataclass
class Report:
    """What `build_report` wrote: `files` (the PNGs, then index.html) and `warnings`."""

    out_dir: Path
    files: list[Path] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def __iter__(self) -> Iterator[Path]:
        return iter(self.files)

    def __len__(self) -> int:
        return len(self.files)


# --- the page ---------------------------------------------------------------------------------


def _summary_rows(result: Mapping[str, Any] | None, g: Goodput, tl: Timeline) -> list[tuple]:
    rows: list[tuple[str, str]] = []
    r = result or {}
    if result is not None:
        rows.append(("status", str(r.get("status", "?"))))
        rows.append(("steps", f"{r.get('steps_completed', '?')} / {r.get('total_steps', '?')}"))
        if num(r.get("final_loss")) is not None:
            rows.append(("final loss", f"{r['final_loss']:.4f}"))
        if num(r.get("wall_seconds")) is not None:
            rows.append(("wall time", f"{r['wall_seconds']:.1f} s"))
        if num(r.get("training_seconds")) is not None:
            rows.append(("training time", f"{r['training_seconds']:.1f} s"))
        if num(r.get("steps_per_second")) is not None:
            rows.append(("throughput", f"{r['steps_per_second']:.2f} steps/s"))
        rows.append(("failures", str(len(as_list(r.get("failures"))))))
        rows.append(("restarts", str(r.get("restarts", "?"))))
        rows.append(("generations", str(r.get("generations", "?"))))
        rows.append(("steps redone", str(r.get("lost_steps_total", "?"))))
        ck = r.get("checkpoint") or {}
        if num(ck.get("capture_ms_mean")) is not None:
            snapshots = f"{ck.get('snapshots', '?')}, {ck['capture_ms_mean']:.2f} ms on the step"
            rows.append(("snapshots", snapshots))
        ps = r.get("persist") or {}
        if ps:
            failed = f", {ps['failures']} failed" if ps.get("failures") else ""
            where = f"{len(as_list(ps.get('persisted')))} to {ps.get('uri', '?')}{failed}"
            rows.append(("durable checkpoints", where))
        err = r.get("error")
        if isinstance(err, Mapping) and err.get("message"):
            rows.append(("error", str(err["message"])))
    else:
        rows.append(("status", "unknown: no result.json (the run did not finish)"))
        steps = [s for s in tl.steps if s is not None]
        if steps:
            rows.append(("newest step seen", str(max(steps))))
        rows.append(("failures seen", str(len(tl.recoveries))))
    if g.whole_job is not None:
        text = f"{g.whole_job:.1%}: productive / wall from the job's first event to its end"
        rows.append(("goodput, whole job (incl. start-up)", text))
    if g.from_exporter:
        text = f"{g.since_running:.1%}: result.json's goodput (the exporter's productive / wall)"
        rows.append(("goodput since RUNNING (the exporter's)", text))
    elif g.since_running is not None:
        text = f"{g.since_running:.1%}: from the events (result.json has no goodput)"
        rows.append(("goodput since RUNNING (estimated)", text))
    return rows


def _failure_rows(result: Mapping[str, Any] | None) -> list[list[str]]:
    out = []
    for f in as_list((result or {}).get("failures")):
        if not isinstance(f, Mapping):
            continue
        out.append(
            [
                str(f.get("kind", "?")),
                str(f.get("rank", "?")),
                str(f.get("step", "?")),
                fmt_secs(num(f.get("detected_after_s"))),
                fmt_secs(num(f.get("recovered_after_s"))),
                str(f.get("steps_redone", "?")),
                str(f.get("message") or ""),
            ]
        )
    return out


def render_html(
    name: str,
    result: Mapping[str, Any] | None,
    g: Goodput,
    tl: Timeline,
    images: list[tuple[str, str]],
    notes: list[str],
) -> str:
    e = html.escape
    status = str((result or {}).get("status", "did not finish"))
    title = f"stalwart report: {name} ({status})"
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{e(title)}</title>",
        "<style>body{font-family:sans-serif;max-width:1340px;margin:1em auto;padding:0 1em}"
        "table{border-collapse:collapse;margin:.5em 0 1em}"
        "td,th{border:1px solid #ccc;padding:.2em .6em;text-align:left;vertical-align:top}"
        "th{background:#f4f4f4}figure{margin:1.5em 0}img{max-width:100%;border:1px solid #eee}"
        "figcaption{color:#444;max-width:1100px}.warn{color:#a04000}</style>",
        "</head><body>",
        f"<h1>{e(title)}</h1>",
    ]
    for w in notes:
        out.append(f'<p class="warn">{e(w)}</p>')
    out.append("<table>")
    for k, v in _summary_rows(result, g, tl):
        out.append(f"<tr><th>{e(k)}</th><td>{e(v)}</td></tr>")
    out.append("</table>")
    failures = _failure_rows(result)
    if failures:
        head = ("kind", "rank", "step", "detected after", "recovered after", "redone", "message")
        out.append("<h2>Failures</h2><table><tr>")
        out.extend(f"<th>{e(h)}</th>" for h in head)
        out.append("</tr>")
        for row in failures:
            out.append("<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>")
        out.append("</table>")
    for file, caption in images:
        out.append(
            f'<figure><img src="{e(file, quote=True)}" alt="{e(file, quote=True)}">'
            f"<figcaption>{e(caption)}</figcaption></figure>"
        )
    out.append("</body></html>")
    return "\n".join(out) + "\n"


# --- the whole report -------------------------------------------------------------------------


def build_report(run_dir: str | Path, out_dir: str | Path | None = None) -> Report:
    """Write the figures and index.html for RUN_DIR to `out_dir` (default RUN_DIR/report)."""
    run = load_run(run_dir)
    out = Path(out_dir) if out_dir is not None else run.run_dir / "report"
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ReportError(f"{out}: cannot create the report directory ({e})") from e
    result = run.result
    name = str((result or {}).get("name") or run.run_dir.name)
    try:
        from stalwart.orchestrator.observe import figures, figures_costs  # matplotlib: to draw
    except ModuleNotFoundError as e:
        if (e.name or "").partition(".")[0] != "matplotlib":
            raise
        raise ReportError(
            "stalwart report draws its figures with matplotlib, which is not installed: "
            "pip install 'stalwart[report]'"
        ) from None

    redone = as_int((result or {}).get("lost_steps_total"))
    exporter = num((result or {}).get("goodput"))
    tl = timeline(run.events)
    g = goodput(run.events, redone, exporter)
    hm = heatmap(run.events)
    report = Report(out_dir=out, warnings=list(run.warnings))
    plots = {
        "timeline.png": lambda p: figures.plot_timeline(tl, name, p),
        "step_time_heatmap.png": lambda p: figures.plot_heatmap(hm, tl, name, p),
        "recovery_phases.png": lambda p: figures_costs.plot_recovery_phases(tl, name, p),
        "checkpoints.png": lambda p: figures_costs.plot_checkpoints(tl, result, name, p),
        "goodput.png": lambda p: figures_costs.plot_goodput(g, name, p),
    }
    try:
        for file, _caption in figures.FIGURES:
            report.files.append(plots[file](out / file))
        page = render_html(name, result, g, tl, list(figures.FIGURES), report.warnings)
        index = out / "index.html"
        index.write_text(page, encoding="utf-8")
    except OSError as e:
        raise ReportError(f"{out}: cannot write the report ({e})") from e
    report.files.append(index)
    return report

"""Live progress and the end-of-run summary in the terminal (rich)."""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from stalwart.orchestrator.observe.logs import live_prefix

_STATE_STYLE = {
    "RUNNING": "green",
    "RECOVERING": "yellow",
    "FAILED": "red",
    "SUCCEEDED": "bold green",
    "CANCELLED": "magenta",
}


class ProgressView:
    """Feeds on the supervisor's progress snapshots and events."""

    def __init__(self, console: Console, name: str):
        self.console = console
        self.name = name
        self._window: deque[tuple[float, int]] = deque(maxlen=40)
        self._live: Live | None = None
        self._last: dict[str, Any] = {}

    def __enter__(self) -> ProgressView:
        self._live = Live(
            self._render(), console=self.console, refresh_per_second=4, transient=False
        )
        self._live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._live.update(self._render())
        self._live.__exit__(*exc)
        if not self.console.is_terminal:  # rich ends the last line only on a terminal
            self.console.line()

    def update(self, progress: dict[str, Any], events: list[dict[str, Any]]) -> None:
        self._last = progress
        self._window.append((progress["now"], progress["step"]))
        for event in events:
            line = _event_line(event)
            if line is not None:
                self._live.console.print(line)
        self._live.update(self._render())

    def output(self, lines: list[dict[str, Any]], all_ranks: bool = False) -> None:
        """The ranks' printed lines above the live line: rank 0's, or every rank's."""
        for line in lines:
            if all_ranks or line.get("rank") == 0:
                self._live.console.print(
                    Text(f"{live_prefix(line)} ", style="dim").append(line["line"], style=""),
                    soft_wrap=True,
                )

    def _rate(self) -> float | None:
        if len(self._window) < 2:
            return None
        (t0, s0), (t1, s1) = self._window[0], self._window[-1]
        return (s1 - s0) / (t1 - t0) if t1 > t0 and s1 >= s0 else None

    def _render(self) -> Text:
        p = self._last
        if not p:
            return Text(f"{self.name}: starting", style="dim")
        rate = self._rate()
        return status_line(self.name, p, rate, self.console.width)


def status_line(name: str, p: dict[str, Any], rate: float | None, width: int) -> Text:
    """One line: state, a bar, step/total, steps/s, loss, goodput, failures, the committed
    step, cordons and the slowest ranks (`stalwart run`'s live line, `stalwart status`)."""
    if rate is None:
        rate = p.get("steps_per_s")
    state = p["state"]
    total = p["total_steps"]
    done = p["step"]
    bar = 12
    fill = int(bar * done / total) if total else 0
    loss = p.get("loss")
    committed = p.get("committed_step")
    line = Text(no_wrap=True, overflow="ellipsis")
    line.append(f"{name} ", style="bold")
    line.append(state, style=_STATE_STYLE.get(state, "cyan"))
    line.append(f" {'█' * fill}{'░' * (bar - fill)} {done}/{total}")
    line.append(f"  {rate:.2f} steps/s" if rate is not None else "  - steps/s")
    line.append(f"  loss {loss:.4f}" if loss is not None else "  loss -")
    goodput = p.get("goodput")
    if goodput is not None:
        line.append(f"  goodput {goodput:.0%}", style="yellow" if goodput < 0.8 else "")
    line.append(f"  failures {p['failures']}", style="red" if p["failures"] else "")
    line.append(f"  ckpt {committed if committed is not None else '-'}")
    if p.get("cordoned"):
        line.append(f"  cordoned {p['cordoned']}", style="yellow")
    slow = [(r, sc) for r, sc in p.get("slowest") or () if sc >= 1.2]
    if slow:
        line.append("  slowest " + ", ".join(f"r{r} {sc:.1f}x" for r, sc in slow))
    line.truncate(max(20, width - 1), overflow="ellipsis")
    return line


def _event_line(e: dict[str, Any]) -> Text | None:
    ts = time.strftime("%H:%M:%S", time.localtime(e["ts"]))
    t = e["type"]
    if t == "state":
        style = _STATE_STYLE.get(e["new"], "cyan")
        return Text(f"{ts} state {e['old']} -> {e['new']}: {e['reason']}", style=style)
    if t == "fault_injected":
        return Text(
            f"{ts} chaos: {e['kind']} rank {e['rank']} at step {e['step']}", style="magenta"
        )
    if t == "decision":
        return Text(f"{ts} decision {e['action']}: {e['reason']}", style="yellow")
    if t == "recovered":
        phases = ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in e["phases_s"].items())
        tiers = e.get("restore_tiers") or {}
        where = (
            " from " + ", ".join(f"{n} rank(s) {tier}" for tier, n in sorted(tiers.items()))
            if tiers
            else ""
        )
        return Text(
            f"{ts} recovered generation {e['generation']} from step {e['restore_step']}"
            f"{where} ({phases})",
            style="green",
        )
    if t == "startup" and startup_text(e):
        return Text(f"{ts} started: {startup_text(e)}", style="cyan")
    if t == "exactness_warning":
        return Text(f"{ts} warning: {e['reason']}", style="yellow")
    if t == "metrics_exporter":
        return Text(f"{ts} metrics at {e['url']}", style="cyan")
    if t == "metrics_unavailable":
        return Text(f"{ts} metrics unavailable: {e['reason']}", style="yellow")
    if t == "supervisor_adopted":
        return Text(f"{ts} {e['reason']}", style="green")
    if t == "resume":
        return Text(f"{ts} {e['reason']}", style="bold cyan")
    if t == "persisted":
        return Text(f"{ts} persisted {e['reason']}", style="cyan")
    if t in ("persist_failed", "checkpoint_skipped", "durable_unavailable"):
        return Text(f"{ts} {t.replace('_', ' ')}: {e['reason']}", style="yellow")
    if t == "replica_plan":
        return Text(f"{ts} checkpoint replicas: {e['reason']}", style="cyan")
    if t == "hang_timeout":
        return Text(f"{ts} hang timeout {e['seconds']:g} s: {e['reason']}", style="cyan")
    if t == "standby_plan":
        return Text(f"{ts} standbys {e['reason']}", style="cyan")
    if t == "abort_timeout":
        return Text(f"{ts} rank {e['rank']} {e['reason']}", style="red")
    if t in ("node_lost", "hang", "gpu_fatal", "gpu_error", "gpu_note", "supervisor_lost"):
        return Text(f"{ts} {t.replace('_', ' ')}: {e['reason']}", style="red")
    if t == "straggler":
        return Text(
            f"{ts} straggler rank {e['rank']}: {e['reason']}; {e['decision']}", style="yellow"
        )
    if t == "stacks":
        files = e.get("files") or {}
        return Text(f"{ts} stacks of {len(files) or len(e['stacks'])} ranks captured", style="red")
    if t in ("cordoned", "uncordoned"):
        return Text(f"{ts} {t} node {e['node'][:12]}: {e['reason']}", style="yellow")
    if t == "preflight" and e["failed"]:
        return Text(f"{ts} preflight: {e['reason']}", style="yellow")
    if t == "resized":
        return Text(f"{ts} world {e['old']} -> {e['new']} ranks: {e['reason']}", style="yellow")
    if t in ("fault_refused", "restart_from_scratch", "preflight_kept", "replication_behind"):
        return Text(f"{ts} {t.replace('_', ' ')}: {e['reason']}", style="magenta")
    return None


def startup_text(startup: dict[str, Any] | None, most: int = 6) -> str | None:
    """One line of the cold start (result.json's `startup`): the time to the first step and
    its longest phases, longest first."""
    if not startup or startup.get("first_step_after_s") is None:
        return None
    longest = sorted(startup["phases_s"].items(), key=lambda kv: kv[1], reverse=True)
    shown = [f"{k} {v:.1f}" for k, v in longest[:most] if v >= 0.05]
    return (
        f"first step after {startup['first_step_after_s']:.1f} s ("
        + ", ".join(shown)
        + (", ..." if len(longest) > len(shown) else "")
        + ")"
    )


def print_summary(console: Console, result: dict[str, Any]) -> None:
    status = result["status"]
    style = {"succeeded": "bold green", "failed": "bold red"}.get(status, "magenta")
    t = Table(
        title=f"stalwart: {result['name']} {status}",
        title_style=style,
        show_header=False,
        box=None,
        padding=(0, 2),
    )
    t.add_row("steps", f"{result['steps_completed']}/{result['total_steps']}")
    if result.get("steps_per_second"):
        t.add_row(
            "throughput",
            f"{result['steps_per_second']:.2f} steps/s, "
            f"{result['samples_per_second']:.1f} samples/s (all steps over the time since "
            "training began, recoveries included)",
        )
    if result.get("final_loss") is not None:
        t.add_row("final loss", f"{result['final_loss']:.4f}")
    t.add_row("wall time", f"{result['wall_seconds']:.1f} s")
    if result.get("goodput") is not None:
        t.add_row(
            "goodput",
            f"{result['goodput']:.1%} of the time since training began was productive "
            "(`stalwart report` also shows it over the whole job, start-up included)",
        )
    t.add_row("failures", str(len(result["failures"])))
    t.add_row("steps redone", str(result["lost_steps_total"]))
    if result.get("cordoned"):
        t.add_row("cordoned", ", ".join(c["node"][:12] for c in result["cordoned"]))
    if result.get("stragglers"):
        t.add_row(
            "stragglers",
            ", ".join(
                f"rank {s['rank']} ({s['score']:.1f}x, {s['action']})" for s in result["stragglers"]
            ),
        )
    if result.get("slow_links"):
        t.add_row(
            "slow links",
            ", ".join(
                f"node {s['node'][:12]} (ranks {', '.join(map(str, s['ranks']))}: "
                + (
                    f"{s['loss']:.1%} of segments sent again)"
                    if s.get("signal") == "loss"
                    else f"{s['rtt_s'] * 1000:.0f} ms, {s['score']:.1f}x)"
                )
                for s in result["slow_links"]
            ),
        )
    if result.get("resizes"):
        t.add_row("resizes", ", ".join(f"{r['from']}->{r['to']}" for r in result["resizes"]))
    if startup_text(result.get("startup")):
        t.add_row("start-up", startup_text(result["startup"]))
    if result.get("model_digest"):
        t.add_row("model digest", result["model_digest"][:16] + "…")
    ck = result.get("checkpoint")
    if ck and ck.get("capture_ms_mean") is not None:
        t.add_row(
            "checkpoint",
            f"{ck['snapshots']} snapshots of {ck['bytes_per_snapshot'] / 1e6:.2f}"
            f" MB, {ck['capture_ms_mean']:.2f} ms on the step",
        )
    rep = result.get("replication")
    if rep and rep.get("copies"):
        t.add_row(
            "replicas",
            f"{rep['copies']} in memory on distinct nodes (asked {rep['replicas']}), "
            f"{rep['sent_bytes'] / 1e6:.1f} MB sent to peers"
            + (
                f", commit <= {rep['max_lag_steps']} steps behind"
                if rep.get("max_lag_steps") is not None and rep["copies"] > 1
                else ""
            )
            + (f", training waited {rep['wait_s']:.1f} s for them" if rep.get("wait_s") else "")
            + (f", {rep['errors']} send errors" if rep.get("errors") else ""),
        )
    ps = result.get("persist")
    if ps:
        t.add_row(
            "durable",
            f"{len(ps['persisted'])} checkpoints to {ps['uri']}"
            + (f", newest step {ps['last_step']}" if ps.get("last_step") is not None else "")
            + (f", {ps['failures']} failed attempts" if ps.get("failures") else ""),
        )
    if result.get("resumed_from") is not None:
        t.add_row("resumed from", f"durable step {result['resumed_from']}")
    parts: list[Any] = [t]
    if result["failures"]:
        f = Table(title="failures", show_lines=False)
        for col in ("kind", "rank", "step", "detected after", "recovered after", "steps redone"):
            f.add_column(col)
        for x in result["failures"]:
            f.add_row(
                x["kind"],
                str(x["rank"]),
                str(x["step"]),
                _ms(x["detected_after_s"]),
                _ms(x["recovered_after_s"]),
                "-" if x["steps_redone"] is None else str(x["steps_redone"]),
            )
        parts.append(f)
    if result.get("error"):
        err = result["error"]
        parts.append(Text(f"error: {err['message']}", style="red"))
        if err.get("output_tail"):
            parts.append(Text(f"rank {err.get('rank')} printed last:", style="red"))
            parts.append(Text("\n".join(f"  {line}" for line in err["output_tail"]), style="dim"))
        if err.get("traceback"):
            parts.append(
                Text(f"rank {err.get('rank')} traceback:\n{err['traceback']}", style="red")
            )
    parts.append(Text(f"output: {result.get('output')}/result.json, events.jsonl", style="dim"))
    console.print(Group(*parts))


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f} ms" if v < 10 else f"{v:.1f} s"

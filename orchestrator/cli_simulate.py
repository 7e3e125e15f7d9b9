"""`stalwart simulate SCENARIO`: effective training time at scale, per strategy, in seconds
(orchestrator/simulate/); `--sweep` runs it once per setting and names the best for
stalwart."""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from stalwart.orchestrator.cli_conventions import (
    EXIT_CANCELLED,
    EXIT_USAGE,
    fail,
    format_option,
    make_console,
    set_option,
)

MAX_SETTINGS = 200
FIGURE_GPUS = (1024, 4096, 16384, 32768, 65536, 98304)


def _settings(sweeps: tuple[str, ...]) -> list[list[str]]:
    """Every combination of the --sweep values, as --set overrides ([[]] with none)."""
    axes = []
    for text in sweeps:
        key, sep, values = text.partition("=")
        parts = [v.strip() for v in values.split(",")]
        if not sep or not key or not all(parts):
            fail(f"--sweep: expected key.path=v1,v2,..., got {text!r}")
        axes.append([f"{key}={v}" for v in parts])
    combos = [list(c) for c in itertools.product(*axes)]
    if len(combos) > MAX_SETTINGS:
        fail(f"--sweep: {len(combos)} settings, at most {MAX_SETTINGS}")
    return combos


@click.command()
@click.argument("scenario", type=click.Path(dir_okay=False), required=False)
@set_option
@click.option("--seeds", type=click.IntRange(1, 1000), default=None, help="runs per strategy")
@click.option(
    "--sweep",
    "sweeps",
    multiple=True,
    metavar="KEY=V1,V2,...",
    help="run once per value (several: every combination) and name stalwart's best "
    "setting, e.g. --sweep costs.stalwart.spares=0,1,4",
)
@click.option(
    "--figure",
    type=click.Path(dir_okay=False),
    default=None,
    help="draw each strategy's ETTR against the GPU count to this PNG (over --sweep "
    f"cluster.gpus=..., by default {','.join(map(str, FIGURE_GPUS))})",
)
@click.option("--schema", is_flag=True, help="print the scenario's JSON Schema and exit")
@format_option("json: the summary per strategy (per setting with --sweep)")
def simulate(
    scenario: str | None,
    overrides: tuple[str, ...],
    seeds: int | None,
    sweeps: tuple[str, ...],
    figure: str | None,
    schema: bool,
    fmt: str,
) -> None:
    """Simulate a job on a large cluster whose parts fail at the SCENARIO's rates: each
    strategy's effective training time (ETTR), the time lost by cause, time to recover,
    steps redone, over several seeds with a 95 % interval. stalwart's answers go through
    the supervisor's own policy code. Exit 2 naming a bad field."""
    from stalwart.orchestrator.simulate.run import report
    from stalwart.orchestrator.simulate.run import simulate as run
    from stalwart.orchestrator.simulate.scenario import Scenario, load_scenario
    from stalwart.orchestrator.spec import SpecError

    err = make_console(stderr=True)
    if schema:
        click.echo(json.dumps(Scenario.model_json_schema(), indent=2))
        return
    if scenario is None:
        fail("SCENARIO: a scenario file is needed (or --schema)")
    base = list(overrides) + ([f"seeds={seeds}"] if seeds else [])
    if figure is not None:
        if any(s.partition("=")[0] != "cluster.gpus" for s in sweeps):
            fail("--figure: it sweeps cluster.gpus; no other --sweep beside it")
        if not sweeps:
            sweeps = (f"cluster.gpus={','.join(map(str, FIGURE_GPUS))}",)
        try:
            from stalwart.orchestrator.simulate.figure import plot_ettr
        except ModuleNotFoundError as e:
            if (e.name or "").partition(".")[0] != "matplotlib":
                raise
            fail(
                "--figure: drawn with matplotlib, which is not installed: "
                "pip install 'stalwart[report]'"
            )
    loaded = []
    for extra in _settings(sweeps):
        try:
            loaded.append((extra, load_scenario(scenario, base + extra)))
        except SpecError as e:
            where = f" (--sweep {', '.join(extra)})" if extra else ""
            err.print(
                f"[red]error:[/red] invalid simulation scenario {e.source}{where}", highlight=False
            )
            for line in e.errors:
                err.print(f"  {line}", highlight=False, markup=False, soft_wrap=True)
            sys.exit(EXIT_USAGE)
    results = []
    try:
        with err.status("simulating") as status:
            for i, (extra, sc) in enumerate(loaded):

                def progress(done: int, total: int, i: int = i) -> None:
                    status.update(
                        f"simulating: setting {i + 1} of {len(loaded)}, seed {done} of {total}"
                    )

                results.append((extra, sc, report(sc, run(sc, progress))))
    except KeyboardInterrupt:
        sys.exit(EXIT_CANCELLED)
    if not sweeps:
        [(_, sc, out)] = results
        if fmt == "json":
            click.echo(json.dumps(out, indent=2))
        else:
            _table(make_console(), sc, out)
        return
    best = _best(results)
    if figure is not None:
        points = sorted(((sc.cluster.gpus, out) for _, sc, out in results), key=lambda p: p[0])
        try:
            plot_ettr(results[0][1].name, points, Path(figure))
        except OSError as e:
            fail(f"--figure: cannot write {figure} ({e.strerror or e})")
        err.print(f"figure: {figure}", highlight=False)
    if fmt == "json":
        swept = [{"setting": _setting(extra), **out} for extra, _, out in results]
        click.echo(json.dumps({"sweep": swept, "best": best}, indent=2))
        return
    _sweep_table(make_console(), results, best)


def _setting(extra: list[str]) -> dict[str, str]:
    return dict(e.split("=", 1) for e in extra)


def _best(results: list[tuple[list[str], Any, dict[str, Any]]]) -> dict[str, Any] | None:
    """stalwart's best setting: the first, in the sweep's order, whose ETTR is within the
    95 % interval of the highest (list the cheaper values first); None when stalwart is
    not simulated."""
    scored = [
        (s["ettr"], s["ettr_ci95"], extra)
        for extra, _, out in results
        for s in out["strategies"]
        if s["strategy"] == "stalwart"
    ]
    if not scored:
        return None
    top, half, _ = max(scored, key=lambda t: t[0])
    ettr, _, extra = next(t for t in scored if t[0] >= top - half)
    return {"setting": _setting(extra), "ettr": ettr, "highest": top}


def _table(console: Console, sc: Any, out: dict[str, Any]) -> None:
    from stalwart.orchestrator.simulate.outcome import LOSSES

    table = Table(
        title=f"{sc.name}: {sc.cluster.gpus:,} GPUs ({sc.cluster.nodes:,} nodes), "
        f"{sc.job.days:g} days, {sc.seeds} seed(s); hours lost by cause"
    )
    for col in (
        "strategy",
        "ETTR",
        "per GPU held",
        "interruptions",
        "detect",
        "restart",
        "restore",
        "redone",
        "checkpoint",
        "cold",
        "manual",
        "slow",
        "MTTR p50",
        "p90",
    ):
        table.add_column(col, justify="left" if col == "strategy" else "right")
    for s in out["strategies"]:
        mttr = s["mttr_s"]
        table.add_row(
            s["strategy"],
            f"{s['ettr']:.2%} ±{s['ettr_ci95']:.2%}",
            f"{s['ettr_per_gpu_held']:.2%}",
            f"{s['interruptions']:g}",
            *(f"{s['lost_hours'][k]:.1f}" for k in LOSSES),
            "-" if mttr["p50"] is None else f"{mttr['p50']} s",
            "-" if mttr["p90"] is None else f"{mttr['p90']} s",
        )
    console.print(table)
    est = out["kokolis_estimate"]["restart-storage"]
    young = est["interval_s"] == out["optimal_save_interval_s"]
    console.print(
        f"restart-storage saves every {est['interval_s']:g} s ("
        + (
            "Young's optimum for its save stall; costs.restart_storage.interval_s sets another)"
            if young
            else f"costs.restart_storage.interval_s; Young's optimum: "
            f"{out['optimal_save_interval_s']:g} s)"
        ),
        highlight=False,
    )
    where = (
        "its assumptions hold here"
        if est["assumptions_hold"]
        else "outside its assumptions: " + "; ".join(est["outside_assumptions"])
    )
    console.print(
        f"Kokolis et al.'s estimate for restart-storage: {est['ettr']:.2%} (MTTF "
        f"{est['mttf_h']:g} h, restart overhead {est['restart_overhead_s']:g} s, interval "
        f"{est['interval_s']:g} s; {where})",
        highlight=False,
    )


def _sweep_table(
    console: Console, results: list[tuple[list[str], Any, dict[str, Any]]], best: Any
) -> None:
    names = [s["strategy"] for s in results[0][2]["strategies"]]
    table = Table(title=f"{results[0][1].name}: ETTR per setting")
    table.add_column("setting")
    for name in names:
        table.add_column(name, justify="right")
    for extra, _, out in results:
        table.add_row(
            ", ".join(extra),
            *(f"{s['ettr']:.2%} ±{s['ettr_ci95']:.2%}" for s in out["strategies"]),
        )
    console.print(table)
    if best is not None:
        setting = ", ".join(f"{k}={v}" for k, v in best["setting"].items())
        console.print(
            f"best for stalwart: {setting} (ETTR {best['ettr']:.2%}; the first setting within "
            f"the 95 % interval of the highest, {best['highest']:.2%})"
        )

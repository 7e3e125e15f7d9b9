"""`stalwart simulate SCENARIO`: effective training time at scale, per strategy, in seconds
(orchestrator/simulate/)."""

from __future__ import annotations

import json
import sys

import click
from rich.table import Table

from stalwart.orchestrator.cli_conventions import (
    EXIT_CANCELLED,
    EXIT_USAGE,
    format_option,
    make_console,
    set_option,
)


@click.command()
@click.argument("scenario", type=click.Path(dir_okay=False), required=False)
@set_option
@click.option("--seeds", type=click.IntRange(1, 1000), default=None, help="runs per strategy")
@click.option("--schema", is_flag=True, help="print the scenario's JSON Schema and exit")
@format_option("json: the summary per strategy")
def simulate(
    scenario: str | None, overrides: tuple[str, ...], seeds: int | None, schema: bool, fmt: str
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
        err.print("[red]error:[/red] SCENARIO: a scenario file is needed (or --schema)")
        sys.exit(EXIT_USAGE)
    try:
        sc = load_scenario(scenario, list(overrides) + ([f"seeds={seeds}"] if seeds else []))
    except SpecError as e:
        err.print(f"[red]error:[/red] invalid simulation scenario {e.source}", highlight=False)
        for line in e.errors:
            err.print(f"  {line}", highlight=False, markup=False, soft_wrap=True)
        sys.exit(EXIT_USAGE)
    try:
        with err.status("simulating") as status:

            def progress(done: int, total: int) -> None:
                status.update(f"simulating: seed {done} of {total}")

            out = report(sc, run(sc, progress))
    except KeyboardInterrupt:
        sys.exit(EXIT_CANCELLED)
    if fmt == "json":
        click.echo(json.dumps(out, indent=2))
        return
    console = make_console()
    table = Table(
        title=f"{sc.name}: {sc.cluster.gpus:,} GPUs ({sc.cluster.nodes:,} nodes), "
        f"{sc.job.days:g} days, {sc.seeds} seed(s)"
    )
    for col in (
        "strategy",
        "ETTR",
        "interruptions",
        "lost h: detect",
        "restart",
        "restore",
        "redone",
        "checkpoint",
        "cold",
        "manual",
        "MTTR p50",
        "p90",
    ):
        table.add_column(col, justify="left" if col == "strategy" else "right")
    for s in out["strategies"]:
        lost = s["lost_hours"]
        table.add_row(
            s["strategy"],
            f"{s['ettr']:.2%} ±{s['ettr_ci95']:.2%}",
            f"{s['interruptions']:g}",
            *(
                f"{lost[k]:.1f}"
                for k in (
                    "detection",
                    "restart",
                    "restore",
                    "redone",
                    "checkpoint",
                    "cold_start",
                    "manual",
                )
            ),
            f"{s['mttr_s']['p50']} s" if s["mttr_s"]["p50"] is not None else "-",
            f"{s['mttr_s']['p90']} s" if s["mttr_s"]["p90"] is not None else "-",
        )
    console.print(table)
    console.print(
        f"restart-storage saves every {out['optimal_save_interval_s']:g} s (Young's optimum "
        "for its save stall) unless the scenario sets costs.restart_storage.interval_s"
    )

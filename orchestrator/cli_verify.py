"""`stalwart verify JOB.yaml`: the job with and without a kill, compared object by object
(orchestrator/verify.py)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from stalwart.orchestrator.cli_conventions import (
    EXIT_FAILED,
    EXIT_USAGE,
    check_entrypoint,
    check_fits,
    discard_if_empty,
    fail,
    format_option,
    load_job,
    make_console,
    new_dirs,
    run_dir_option,
    spec_dir,
)


@click.command()
@click.argument("file", type=click.Path(dir_okay=False, allow_dash=True))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="override a field")
@click.option("--steps", type=int, default=None, help="steps of each run (default: the spec's)")
@click.option("--kill-at", type=int, default=None, help="the step the kill happens before")
@click.option("--rank", type=int, default=1, show_default=True, help="the rank killed")
@click.option(
    "--address",
    envvar="RAY_ADDRESS",
    default=None,
    help="Ray cluster (default: RAY_ADDRESS, else an embedded local Ray)",
)
@run_dir_option("where both runs and their final checkpoints go (default runs/verify-NAME-TIME)")
@click.option(
    "--storage",
    default=None,
    help="where both runs' final checkpoints go, a path or fsspec URL every node can write "
    "(default RUN_DIR/checkpoints: an embedded Ray or a cluster on this machine)",
)
@click.option("--num-cpus", type=int, default=None, help="logical CPUs of the embedded Ray")
@format_option("json: print the verdict as JSON")
def verify(
    file: str,
    overrides: tuple[str, ...],
    steps: int | None,
    kill_at: int | None,
    rank: int,
    address: str | None,
    run_dir: str | None,
    storage: str | None,
    num_cpus: int | None,
    fmt: str,
) -> None:
    """Run FILE's job twice, without and with a worker killed, and say whether every
    registered object ends identical (exit 0) or not (exit 1, naming the first tensor that
    differs)."""
    from stalwart.orchestrator.driver import ClusterUnreachable, RunOptions, run_job
    from stalwart.orchestrator.verify import VerifyError, plan
    from stalwart.orchestrator.verify import verify as run_verify

    err = make_console(stderr=True)
    spec = load_job(file, overrides, err)
    try:
        plan(spec, steps, kill_at, rank)
    except VerifyError as e:
        err.print(f"[red]error:[/red] {e}", highlight=False, markup=False)
        sys.exit(EXIT_USAGE)
    if not address:  # what `stalwart run` checks before starting an embedded Ray
        check_entrypoint(spec, file, err)
        check_fits(spec, file, None, num_cpus, err)
    out = Path(run_dir or f"runs/verify-{spec.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    created = new_dirs(out)  # removed again if neither run starts
    base_dir = spec_dir(file)
    console = make_console(stderr=fmt == "json")

    def run(variant, run_dir: Path):
        console.print(f"stalwart verify: {run_dir.name} run -> {run_dir}", highlight=False)
        opts = RunOptions(
            address=address,
            output=run_dir,
            base_dir=base_dir,
            num_cpus=num_cpus,
            resume="never",
            allow_remote_chaos=True,  # the kill is what `stalwart verify` is for
        )
        return run_job(variant, opts)

    try:
        verdict = run_verify(spec, run, out, steps, kill_at, rank, storage)
    except ClusterUnreachable as e:
        discard_if_empty(created)
        fail(str(e), EXIT_USAGE)
    if fmt == "json":
        click.echo(json.dumps(verdict.to_json(), indent=2))
    else:
        _print(console, verdict)
    sys.exit(0 if verdict.identical else EXIT_FAILED)


def _print(console: Console, verdict) -> None:
    title = (
        f"{verdict.steps} steps, rank {verdict.rank} killed at step {verdict.kill_at}, "
        "against the failure-free run"
    )
    if verdict.error:
        console.print(f"[red]verify: {verdict.error}[/red]", highlight=False, soft_wrap=True)
        return
    table = Table(title=title)
    for col in ("object", "ranks", "after the recovery", "first difference"):
        table.add_column(col)
    names = sorted({d.name for diffs in verdict.diffs.values() for d in diffs})
    for name in names:
        per_rank = {r: d for r, diffs in verdict.diffs.items() for d in diffs if d.name == name}
        bad = {r: d for r, d in per_rank.items() if not d.identical}
        if not bad:
            table.add_row(name, "all", "[green]identical[/green]", "")
            continue
        first_rank = min(bad)
        d = bad[first_rank]
        where = f"{d.path}: {d.detail}" if d.path else str(d.detail)
        table.add_row(name, ", ".join(map(str, sorted(bad))), "[red]differs[/red]", where)
    console.print(table)
    for warning in verdict.warnings:
        console.print(f"[yellow]warning:[/yellow] {warning}", highlight=False, soft_wrap=True)
    if verdict.identical:
        console.print(
            "[green]PASS[/green]: the recovered run ends with the same state, bit for bit"
        )
    else:
        console.print(
            "[red]FAIL[/red]: the recovery changed the result; docs/exactness.md lists what "
            "must hold for it not to",
            highlight=False,
        )

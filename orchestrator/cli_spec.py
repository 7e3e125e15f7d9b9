"""`stalwart validate FILE` (what `stalwart run` checks before starting anything) and
`stalwart schema` (the job spec's JSON Schema)."""

from __future__ import annotations

import json

import click

from stalwart.orchestrator.cli_conventions import (
    check_entrypoint,
    check_fits,
    format_option,
    load_job,
    make_console,
    set_option,
)


@click.command()
@click.argument("file", type=click.Path(dir_okay=False, allow_dash=True))
@set_option
@click.option(
    "--address",
    envvar="RAY_ADDRESS",
    default=None,
    help="check the job against this Ray cluster's nodes (ray://HOST:10001, HOST:6379 or "
    "auto; default: $RAY_ADDRESS, else this machine, as `stalwart run` would use it)",
)
@click.option("--num-cpus", type=int, default=None, help="logical CPUs of the embedded Ray")
@format_option("json: print the validated spec")
def validate(
    file: str, overrides: tuple[str, ...], address: str | None, num_cpus: int | None, fmt: str
) -> None:
    """Check a job spec (FILE, or - for standard input) as `stalwart run` would before
    starting anything: every field (each error with its field path), the entrypoint
    importing (without a cluster) and the job fitting this machine or the cluster at
    --address. Exit 2 listing what is wrong."""
    err = make_console(stderr=True)
    spec = load_job(file, overrides, err)
    if not address:
        check_entrypoint(spec, file, err)
    check_fits(spec, file, address, num_cpus, err)
    if fmt == "json":
        click.echo(json.dumps(spec.model_dump(mode="json"), indent=2))
        return
    where = f"the cluster at {address}" if address else "this machine"
    name = "<stdin>" if file == "-" else file
    click.echo(f"{name}: valid ({spec.max_workers} workers, {spec.steps} steps; fits {where})")


@click.command()
def schema() -> None:
    """Print the job spec's JSON Schema (for editors)."""
    from stalwart.orchestrator.spec import json_schema

    click.echo(json.dumps(json_schema(), indent=2))

"""What every `stalwart` subcommand shares, wherever it is defined (orchestrator/cli.py,
orchestrator/cli_dashboards.py): exit codes and the `-o/--output-format` option."""

from __future__ import annotations

import sys

import click
from rich.console import Console

from stalwart.orchestrator.spec import JobSpec, SpecError, load_spec

EXIT_FAILED = 1  # the job, or the service asked (Grafana), failed
EXIT_USAGE = 2  # bad input: a spec, a file, an address, a token
EXIT_CANCELLED = 130  # Ctrl-C


def format_option(help_json: str):
    """`-o/--output-format text|json` (kubectl's habit), into the parameter `fmt`."""
    return click.option(
        "-o",
        "--output-format",
        "fmt",
        type=click.Choice(["text", "json"]),
        default="text",
        help=help_json,
    )


def load_job(file: str, overrides: tuple[str, ...], console: Console) -> JobSpec:
    """The job spec in `file` with `--set` overrides, or exit 2 listing every error."""
    try:
        return load_spec(file, list(overrides))
    except SpecError as e:
        console.print(f"[red]error:[/red] invalid job spec {e.source}", highlight=False)
        for line in e.errors:
            console.print(f"  {line}", highlight=False, markup=False, soft_wrap=True)
        sys.exit(EXIT_USAGE)


def job_supervisor(address: str, job: str, err: Console):
    """Running job `job`'s supervisor on the cluster at `address` (Ray stays connected:
    the caller shuts it down), or exit 2 with the reason."""
    from rich.markup import escape

    from stalwart.orchestrator.compat import UnsupportedDependency
    from stalwart.orchestrator.driver import ClusterUnreachable, find_supervisor

    try:
        return find_supervisor(address, job)
    except (ClusterUnreachable, LookupError, UnsupportedDependency) as e:
        err.print(f"[red]error:[/red] {escape(str(e))}", highlight=False, soft_wrap=True)
        sys.exit(EXIT_USAGE)

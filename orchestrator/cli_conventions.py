"""What every `stalwart` subcommand shares, wherever it is defined (orchestrator/cli.py,
orchestrator/cli_dashboards.py): exit codes and the `-o/--output-format` option."""

from __future__ import annotations

import click

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

"""`stalwart dashboards export|push`: get the dashboards into Grafana (dashboards/provision.py).

Exit codes (docs/cli.md): 0 done; 2 bad input: our side (no or bad token, bad URL or
directory) or the address (Grafana unreachable, not Grafana, the token refused, no Prometheus
datasource: any answer but a 5xx); 1 Grafana failed (it answered HTTP 5xx). Errors go to
stderr, starting with `error:`. dashboards.provision imports grafana-client only when a push
runs, so `stalwart --help` stays quick.
"""

from __future__ import annotations

import json
import sys
from typing import NoReturn

import click
from rich.text import Text

from stalwart.dashboards.provision import DEFAULT_TIMEOUT_S, FOLDER
from stalwart.orchestrator.cli_conventions import (
    EXIT_FAILED,
    EXIT_USAGE,
    format_option,
    make_console,
)


def _fail(message: str, code: int) -> NoReturn:
    make_console(stderr=True).print(
        Text.assemble(("error:", "red"), " ", message), highlight=False, soft_wrap=True
    )
    sys.exit(code)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def dashboards() -> None:
    """Grafana dashboards: export them for file provisioning, or push them to a Grafana."""


@dashboards.command("export", short_help="Write the JSON and a Grafana provisioning YAML into DIR.")
@click.argument("directory", metavar="DIR", type=click.Path())
@click.option(
    "--folder",
    default=FOLDER,
    show_default=True,
    help="the Grafana folder the provisioning file puts the dashboards in",
)
@click.option(
    "--grafana-path",
    metavar="PATH",
    default=None,
    help="where Grafana reads DIR's JSON files, when not at DIR's absolute path here "
    "(a container mount, another host); written into the provisioning file",
)
@format_option("json: print what was written as JSON")
def export_command(directory: str, folder: str, grafana_path: str | None, fmt: str) -> None:
    """Write the four dashboards' JSON and a Grafana file-provisioning YAML
    (stalwart-dashboards.yaml, a file provider for DIR) into DIR."""
    from stalwart.dashboards.provision import ProvisionError, export

    try:
        done = export(directory, folder=folder, grafana_path=grafana_path)
    except ProvisionError as e:
        _fail(str(e), EXIT_USAGE)
    if fmt == "json":
        click.echo(json.dumps(done.to_dict(), indent=2))
        return
    for path in done.dashboards:
        click.echo(path)
    click.echo(done.provisioning)
    click.echo(
        f"put {done.provisioning} into Grafana's provisioning/dashboards/ directory; it loads "
        f"the dashboards from {done.grafana_path} into the folder {done.folder}"
    )


@dashboards.command("push", short_help="Upload the dashboards to a Grafana, overwriting by uid.")
@click.option(
    "--grafana-url",
    metavar="URL",
    envvar="GRAFANA_URL",
    default=None,
    help="Grafana's root URL, e.g. http://127.0.0.1:3000 (default: $GRAFANA_URL)",
)
@click.option(
    "--token-file",
    metavar="FILE",
    default=None,
    help="a file holding the Grafana service account token (whitespace around it is "
    "stripped); wins over $GRAFANA_TOKEN when both are given",
)
@click.option(
    "--folder",
    default=FOLDER,
    show_default=True,
    help="the Grafana folder (by title; created when missing)",
)
@click.option(
    "--datasource",
    metavar="NAME",
    default=None,
    help="the Prometheus datasource (name or uid) the dashboards default to (default: the "
    "org's default datasource if it is Prometheus, else the first Prometheus one)",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True),
    metavar="SECONDS",
    default=DEFAULT_TIMEOUT_S,
    show_default=True,
    help="seconds to wait for each Grafana answer",
)
@format_option("json: print what was pushed as JSON")
def push_command(
    grafana_url: str | None,
    token_file: str | None,
    folder: str,
    datasource: str | None,
    timeout: float,
    fmt: str,
) -> None:
    """Upload the dashboards to a Grafana (grafana-client), overwriting them by uid.

    The token (a service account token with the Editor role) comes from $GRAFANA_TOKEN or
    from --token-file, which wins when both are given. It is never printed.
    """
    from stalwart.dashboards.provision import (
        ConfigError,
        GrafanaError,
        ProvisionError,
        push,
        read_token,
    )

    if not grafana_url:
        _fail("no Grafana URL: pass --grafana-url URL or set GRAFANA_URL", EXIT_USAGE)
    try:
        token = read_token(token_file)
        result = push(grafana_url, token, folder, datasource, timeout=timeout)
    except ConfigError as e:
        _fail(str(e), EXIT_USAGE)
    except GrafanaError as e:
        # Unreachable, not Grafana, the token refused, no datasource: the address given is
        # not what it must be (2). Grafana answering 5xx failed itself (1).
        failed = e.status is not None and e.status >= 500
        _fail(str(e), EXIT_FAILED if failed else EXIT_USAGE)
    except ProvisionError as e:  # our dashboards lack what the push needs
        _fail(str(e), EXIT_FAILED)
    if fmt == "json":
        click.echo(json.dumps(result.to_dict(), indent=2))
        return
    version = f"Grafana {result.grafana_version}" if result.grafana_version else "Grafana"
    state = "created" if result.folder_created else "existing"
    click.echo(
        f"{version} at {result.grafana_url}: folder {result.folder_title} ({state}, uid "
        f"{result.folder_uid}), datasource {result.datasource_name} (uid {result.datasource_uid})"
    )
    width = max((len(board.uid) for board in result.dashboards), default=0)
    for board in result.dashboards:
        click.echo(f"  {board.uid:<{width}}  version {board.version}  {board.url}")
    click.echo(f"pushed {len(result.dashboards)} dashboards")

"""What every `stalwart` subcommand shares, wherever it is defined (orchestrator/cli.py and
the cli_* modules); docs/cli.md states it for users.

- Exit codes: 0 done, 1 the job (or the service asked: a Grafana answering 5xx) failed,
  2 bad input (a spec, a file, an address that cannot be reached or is not what was
  expected, a token refused), 130 cancelled.
- `-o/--output text|json` is the output format in every subcommand that has one
  (`--output-format` is its hidden old name); a directory is `--run-dir` or `--out-dir`.
- A spec FILE may be `-` (standard input); a relative entrypoint then resolves against the
  current directory.
- What goes to a pipe or a file is not wrapped at 80 columns (`make_console`).
- Errors are `error: ...` on stderr, one screen at most, never a traceback.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
from pathlib import Path
from typing import NoReturn

import click
from rich.console import Console
from rich.markup import escape

from stalwart.orchestrator.spec import JobSpec, SpecError, load_spec

EXIT_FAILED = 1  # the job, or the service asked (a Grafana answering 5xx), failed
EXIT_USAGE = 2  # bad input: a spec, a file, an address, a token
EXIT_CANCELLED = 130  # Ctrl-C

PIPE_WIDTH = 4096  # columns of a Console that writes to a pipe or a file (no wrapping)


def result_exit_code(status: str) -> int:
    """The exit code of a run whose result.json says `status`."""
    return {"succeeded": 0, "cancelled": EXIT_CANCELLED}.get(status, EXIT_FAILED)


def make_console(stderr: bool = False) -> Console:
    """A rich Console for stdout (or stderr): a terminal's width on a terminal; to a pipe or
    a file, lines as long as they are (rich would wrap them at 80 columns), unless COLUMNS
    says otherwise."""
    console = Console(stderr=stderr)
    if console.is_terminal or os.environ.get("COLUMNS"):
        return console
    return Console(stderr=stderr, width=PIPE_WIDTH, soft_wrap=True)


def fail(message: str, code: int = EXIT_USAGE) -> NoReturn:
    """`error: MESSAGE` on stderr (no markup read in it), then exit `code`."""
    make_console(stderr=True).print(
        f"[red]error:[/red] {escape(message)}", highlight=False, soft_wrap=True
    )
    sys.exit(code)


class _Format(click.Choice):
    """text or json; a value that is neither is most likely a directory given the way
    `--output DIR` used to be: say which option takes it."""

    def __init__(self) -> None:
        super().__init__(["text", "json"])

    def convert(self, value, param, ctx):
        try:
            return super().convert(value, param, ctx)
        except click.BadParameter:
            flags = {o for p in ctx.command.params for o in p.opts} if ctx is not None else set()
            hint = ""
            if "--run-dir" in flags:
                hint = f"; a run directory is --run-dir {value}"
            elif "--out-dir" in flags:
                hint = f"; a directory is --out-dir {value}"
            self.fail(
                f"{value!r}: expected text or json (-o/--output is the output format{hint})",
                param,
                ctx,
            )


def format_option(help_json: str):
    """`-o/--output text|json` (kubectl's habit), into the parameter `fmt`; the old
    `--output-format` still works, hidden."""

    def decorate(f):
        @functools.wraps(f)
        def command(*args, **kwargs):
            old = kwargs.pop("fmt_old_name", None)
            if kwargs.get("fmt") is None:
                kwargs["fmt"] = old or "text"
            return f(*args, **kwargs)

        command = click.option(
            "--output-format", "fmt_old_name", type=_Format(), default=None, hidden=True
        )(command)
        return click.option(
            "-o",
            "--output",
            "fmt",
            type=_Format(),
            default=None,
            help=f"output format: text (the default) or {help_json}",
        )(command)

    return decorate


set_option = click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY=VALUE",
    help="override a spec field; VALUE is parsed as YAML (repeatable)",
)


def run_dir_option(help_text: str, name: str = "--run-dir"):
    """`--run-dir DIR` (or `--out-dir DIR`): where a command writes its directory."""
    return click.option(
        name,
        name.lstrip("-").replace("-", "_"),
        metavar="DIR",
        type=click.Path(file_okay=False),
        default=None,
        help=help_text,
    )


def load_job(file: str, overrides: tuple[str, ...], console: Console) -> JobSpec:
    """The job spec in `file` (`-`: standard input) with `--set` overrides, or exit 2
    listing every error."""
    try:
        return load_spec(file, list(overrides))
    except SpecError as e:
        console.print(
            f"[red]error:[/red] invalid job spec {escape(e.source)}",
            highlight=False,
            soft_wrap=True,
        )
        for line in e.errors:
            console.print(f"  {line}", highlight=False, markup=False, soft_wrap=True)
        sys.exit(EXIT_USAGE)


def spec_dir(file: str) -> str:
    """Where FILE's relative entrypoint (`path/to/file.py:fn`) is found: FILE's directory,
    or the current one for `-`."""
    return str(Path.cwd() if file == "-" else Path(file).resolve().parent)


def check_entrypoint(spec: JobSpec, file: str, err: Console, base_dir: str | None = None) -> None:
    """Exit 2 unless the spec's entrypoint imports here (what the workers of an embedded
    Ray do; a cluster may have code this machine lacks, so callers ask only without one).
    Relative entrypoints resolve in `base_dir`, by default FILE's directory."""
    from stalwart.orchestrator.worker.entrypoint import EntrypointError, load_entrypoint

    try:
        load_entrypoint(spec.entrypoint, base_dir or spec_dir(file))
    except EntrypointError as e:
        err.print(f"[red]error:[/red] {escape(_source(file))}: entrypoint", highlight=False)
        err.print(f"  {e}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(EXIT_USAGE)


def check_fits(
    spec: JobSpec, file: str, address: str | None, num_cpus: int | None, err: Console
) -> None:
    """Exit 2 unless the job fits: this machine (an embedded Ray) when `address` is None,
    else the cluster there (connecting to it; an unreachable one is exit 2 too)."""
    from stalwart.orchestrator import capacity

    if address:
        problems = _cluster_problems(spec, address, err)
        where = f"the Ray cluster at {address}"
    else:
        problems = capacity.this_machine(spec, num_cpus)
        where = "this machine"
    if problems:
        err.print(
            f"[red]error:[/red] {escape(_source(file))}: the job does not fit {escape(where)}",
            highlight=False,
            soft_wrap=True,
        )
        for line in problems:
            err.print(f"  {line}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(EXIT_USAGE)


def _cluster_problems(spec: JobSpec, address: str, err: Console) -> list[str]:
    import ray

    from stalwart.orchestrator import capacity
    from stalwart.orchestrator.compat import UnsupportedDependency
    from stalwart.orchestrator.driver import ClusterUnreachable, connect

    try:
        connect(address, spec, None, 10.0)
    except (ClusterUnreachable, UnsupportedDependency) as e:
        err.print(f"[red]error:[/red] {escape(str(e))}", highlight=False, soft_wrap=True)
        sys.exit(EXIT_USAGE)
    try:
        return capacity.cluster(spec, ray.nodes())
    finally:
        ray.shutdown()


def _source(file: str) -> str:
    return "<stdin>" if file == "-" else file


def new_dirs(path: Path) -> Path | None:
    """The outermost of `path` and its parents that does not exist yet (what a
    `mkdir(parents=True)` of `path` creates), or None when `path` exists."""
    path = Path(path).absolute()
    if path.exists():
        return None
    top = path
    while not top.parent.exists() and top.parent != top:
        top = top.parent
    return top


def discard_if_empty(created: Path | None) -> None:
    """Remove the directories a failed start created (`new_dirs`) when nothing in them
    holds a byte (the empty events.jsonl of a run that never connected): a failed
    connection leaves no empty run directory behind."""
    if created is None or not created.is_dir():
        return
    if any(p.is_file() and p.stat().st_size for p in created.rglob("*")):
        return
    shutil.rmtree(created, ignore_errors=True)


def job_supervisor(address: str, job: str, err: Console):
    """Running job `job`'s supervisor on the cluster at `address` (Ray stays connected:
    the caller shuts it down), or exit 2 with the reason."""
    from stalwart.orchestrator.compat import UnsupportedDependency
    from stalwart.orchestrator.driver import ClusterUnreachable, find_supervisor

    try:
        return find_supervisor(address, job)
    except (ClusterUnreachable, LookupError, UnsupportedDependency) as e:
        err.print(f"[red]error:[/red] {escape(str(e))}", highlight=False, soft_wrap=True)
        sys.exit(EXIT_USAGE)

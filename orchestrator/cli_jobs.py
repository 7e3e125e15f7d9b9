"""`stalwart submit`, `stop`, `list`, and `status`/`logs` of a job on a Ray cluster's Jobs API
(an http(s) address: the head's dashboard, http://HEAD:8265)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.markup import escape

from stalwart.orchestrator.cli_conventions import (
    EXIT_CANCELLED,
    EXIT_FAILED,
    fail,
    format_option,
    load_job,
    make_console,
    result_exit_code,
    spec_dir,
)
from stalwart.orchestrator.jobs import TERMINAL, Job, Jobs, JobsError

STATUS_WATCH_S = 2.0


def jobs_address_option(required: bool = True):
    return click.option(
        "--address",
        envvar="RAY_ADDRESS",
        required=required,
        default=None,
        help="the cluster's Jobs API: http://HEAD:8265 (default: $RAY_ADDRESS)",
    )


def auth_options(fn):
    fn = click.option(
        "--header",
        "headers",
        multiple=True,
        metavar="'NAME: VALUE'",
        help="an HTTP header for a cluster behind a proxy (repeatable; also $RAY_JOB_HEADERS, "
        "a JSON object)",
    )(fn)
    return click.option(
        "--token-file",
        type=click.Path(dir_okay=False),
        default=None,
        help="a file holding a bearer token for the cluster's proxy (default: "
        "$STALWART_RAY_TOKEN); never printed",
    )(fn)


def connect(address: str, headers: tuple[str, ...], token_file: str | None) -> Jobs:
    from stalwart.orchestrator.jobs import is_jobs_address, parse_headers, read_secret

    if not is_jobs_address(address):
        fail(
            f"--address {address!r}: expected the Jobs API of a Ray head, http://HEAD:8265 "
            "(or https://)",
        )
    try:
        return Jobs(address, parse_headers(headers), read_secret(token_file))
    except JobsError as e:
        fail(str(e))


def find(jobs: Jobs, job: str) -> Job:
    try:
        return jobs.find(job)
    except JobsError as e:
        fail(str(e))


@click.command()
@click.argument("file", type=click.Path(dir_okay=False, allow_dash=True))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="override a field")
@jobs_address_option()
@auth_options
@click.option(
    "--working-dir",
    type=click.Path(file_okay=False, exists=True),
    default=".",
    show_default=True,
    help="uploaded to the cluster (.gitignore and .rayignore respected); the entrypoint's "
    "relative paths resolve in it",
)
@click.option("--exclude", "excludes", multiple=True, help="leave PATTERN out of the upload")
@click.option(
    "--run-dir",
    default=None,
    help="the run directory on the head node (default: ~/stalwart-runs/ID, in the home of "
    "the user Ray runs as)",
)
@click.option("--resume", default="auto", show_default=True, help="as for `stalwart run`")
@click.option("--allow-remote", is_flag=True, help="allow the spec's chaos faults there")
@format_option("json: print the submitted job as JSON")
def submit(
    file: str,
    overrides: tuple[str, ...],
    address: str,
    headers: tuple[str, ...],
    token_file: str | None,
    working_dir: str,
    excludes: tuple[str, ...],
    run_dir: str | None,
    resume: str,
    allow_remote: bool,
    fmt: str,
) -> None:
    """Send the job in FILE to a Ray cluster through its Jobs API and return its id; it
    trains there whether or not this machine stays connected."""
    import yaml

    err = Console(stderr=True)
    spec = load_job(file, overrides, err)
    wd = Path(working_dir).resolve()
    try:
        base_dir = str(Path(spec_dir(file)).relative_to(wd))
    except ValueError:
        base_dir = "."
        if ".py:" in spec.entrypoint and not spec.entrypoint.startswith("/"):
            fail(
                f"{file}: its entrypoint {spec.entrypoint!r} is a path relative to the spec, "
                f"which is outside the uploaded working directory {wd}: submit from a "
                "directory above it (--working-dir)",
            )
    if spec.chaos.faults and not (spec.chaos.enabled and allow_remote):
        fail(
            f"{file}: refusing {len(spec.chaos.faults)} chaos fault(s) on a cluster this "
            "command did not start: that needs `chaos.enabled: true` in the spec and "
            "--allow-remote",
        )
    jobs = connect(address, headers, token_file)
    text = yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False)
    try:
        job = jobs.submit(
            text,
            spec.name,
            wd,
            base_dir,
            spec.runtime_env,
            list(excludes),
            run_dir=run_dir,
            resume=resume,
            allow_remote=allow_remote,
        )
    except JobsError as e:
        fail(str(e))
    if fmt == "json":
        click.echo(json.dumps({**job.to_dict(), "address": jobs.address}))
        return
    click.echo(job.submission_id)
    err.print(
        f"submitted {spec.name} to {jobs.address} (Ray {jobs.ray_version}); follow it with\n"
        f"  stalwart status {job.submission_id} -w --address {jobs.address}\n"
        f"  stalwart logs {job.submission_id} -f --address {jobs.address}",
        highlight=False,
        soft_wrap=True,
    )


@click.command(name="stop")
@click.argument("job")
@jobs_address_option()
@auth_options
@click.option("--no-wait", is_flag=True, help="return once the stop was asked for")
def stop(job: str, address: str, headers: tuple[str, ...], token_file: str | None, no_wait: bool):
    """Stop JOB (its id or name): the supervisor aborts the workers and result.json is
    still written in the job's run directory."""
    jobs = connect(address, headers, token_file)
    found = find(jobs, job)
    try:
        asked = jobs.stop(found)
        if not asked:
            click.echo(f"{found.submission_id} had already ended ({found.status})")
            return
        deadline = time.monotonic() + 120
        while not no_wait and jobs.state(found) not in TERMINAL:
            if time.monotonic() > deadline:
                fail(f"{found.submission_id} had not stopped 120 s after the stop", 1)
            time.sleep(1.0)  # polling the Jobs API, bounded by the deadline
        _, result = jobs.status(found)
    except JobsError as e:
        fail(str(e))
    click.echo(
        f"stopped {found.submission_id}"
        + (f" at step {result.get('steps_completed')}" if result else "")
    )


@click.command(name="list")
@jobs_address_option()
@auth_options
@format_option("json: print the jobs as a JSON list")
def list_jobs(address: str, headers: tuple[str, ...], token_file: str | None, fmt: str) -> None:
    """stalwart's jobs on a Ray cluster, newest first, with their state."""
    err = Console(stderr=True)
    jobs = connect(address, headers, token_file)
    try:
        found = jobs.list()
    except JobsError as e:
        fail(str(e))
    if fmt == "json":
        click.echo(json.dumps([j.to_dict() for j in found]))
        return
    console = make_console()
    from rich.table import Table

    table = Table(box=None, header_style="bold")
    for col in ("ID", "NAME", "STATE", "STARTED", "RUN DIR"):
        table.add_column(col)
    for j in found:
        started = time.strftime("%Y-%m-%d %H:%M", time.localtime(j.start_time or 0))
        table.add_row(j.submission_id, j.name, j.status, started, j.run_dir or "")
    console.print(table)
    if not found:
        err.print(f"no stalwart jobs on {jobs.address}", highlight=False)


@click.command(name="fetch-run-dir", hidden=True)
@click.argument("run_dir", type=click.Path(file_okay=False))
def fetch_run_dir(run_dir: str) -> None:
    """(Run on the cluster by `status --fetch`.) Print RUN_DIR as an archive."""
    from stalwart.orchestrator.jobs import archive_lines

    path = Path(run_dir).expanduser()
    if not path.is_dir():
        fail(f"{run_dir}: no such run directory on this node")
    try:
        for line in archive_lines(path):
            click.echo(line)
    except JobsError as e:
        fail(str(e))


def jobs_status(
    job: str,
    address: str,
    headers: tuple[str, ...],
    token_file: str | None,
    fmt: str,
    watch: bool,
    fetch: str | None,
) -> None:
    """`stalwart status` of a job on the Jobs API: stalwart's own view from the driver's
    status records; exit 0 running or succeeded, 1 failed, 130 stopped."""
    from stalwart.orchestrator.observe.progress import print_summary, status_line

    err = Console(stderr=True)
    console = make_console()
    jobs = connect(address, headers, token_file)
    found = find(jobs, job)
    try:
        while True:
            found = jobs.get(found.submission_id)
            progress, result = jobs.status(found)
            if fmt == "json":
                click.echo(
                    json.dumps({"job": found.to_dict(), "progress": progress, "result": result})
                )
            elif result is not None:
                print_summary(console, result)
            elif progress is not None:
                # make_console: a terminal's width, or unwrapped into a pipe
                console.print(status_line(found.name, progress, None, console.width))
            else:
                click.echo(f"{found.submission_id}: {found.status} (no progress reported yet)")
            if not watch or found.status in TERMINAL:
                break
            time.sleep(STATUS_WATCH_S)
    except KeyboardInterrupt:
        return
    except JobsError as e:
        fail(str(e))
    if fetch:
        try:
            files = jobs.fetch(found, Path(fetch))
        except JobsError as e:
            fail(str(e))
        err.print(f"fetched {len(files)} file(s) of {found.run_dir} into {fetch}", highlight=False)
    if found.status in TERMINAL and found.status != "SUCCEEDED" and fmt != "json":
        reason = (result or {}).get("error") or {}
        if found.message or reason:
            err.print(
                f"{found.submission_id}: {found.status}: "
                f"{escape(str(reason.get('message') or found.message))}",
                highlight=False,
                soft_wrap=True,
            )
    sys.exit(exit_code(found, result))


def exit_code(job: Job, result: dict[str, Any] | None) -> int:
    """The driver's result decides; before there is one, Ray's state does."""
    status = (result or {}).get("status")
    if status is not None:
        return result_exit_code(status)
    if job.status in ("SUCCEEDED", "RUNNING", "PENDING"):
        return 0
    return EXIT_CANCELLED if job.status == "STOPPED" else EXIT_FAILED


def jobs_logs(
    job: str,
    address: str,
    headers: tuple[str, ...],
    token_file: str | None,
    rank: int | None,
    follow: bool,
) -> None:
    from stalwart.orchestrator.jobs import user_lines

    jobs = connect(address, headers, token_file)
    found = find(jobs, job)
    try:
        lines = jobs.follow(found) if follow else jobs.logs(found).splitlines()
        for line in user_lines(lines, rank):
            click.echo(line)
    except KeyboardInterrupt:
        sys.exit(EXIT_CANCELLED)
    except JobsError as e:
        fail(str(e))


def remote_chaos_run(
    scenarios: tuple[str, ...],
    overrides: tuple[str, ...],
    address: str,
    headers: tuple[str, ...],
    token_file: str | None,
    allow_remote: bool,
    junit_path: str | None,
    no_cache: bool,
    prometheus_url: str | None,
    fmt: str,
) -> None:
    """`stalwart chaos run --address http://HEAD:8265`: the scenarios run on the cluster as
    a job of their own (this directory uploaded, as `submit` does), their output followed
    here; exit as the chaos run there exits (Ctrl-C stops it)."""
    import shlex
    import tempfile
    import uuid

    from stalwart.orchestrator.jobs import user_lines

    if not allow_remote:
        fail(
            f"faults on the cluster at {address}, which this command did not start, need "
            "--allow-remote (and `chaos.enabled: true` in each scenario's job spec)"
        )
    wd = Path.cwd()
    rel = []
    for path in scenarios:
        try:
            rel.append(str(Path(path).resolve().relative_to(wd)))
        except ValueError:
            fail(f"{path}: outside the directory uploaded to the cluster ({wd}): run from above it")
    jobs = connect(address, headers, token_file)
    submission_id = f"stalwart-chaos-{uuid.uuid4().hex[:8]}"
    run_dir = f"~/stalwart-runs/{submission_id}"
    args = ["stalwart", "chaos", "run", *rel, "--allow-remote", "--run-dir", run_dir, "-o", fmt]
    args += ["--junit", f"{run_dir}/junit.xml"] if junit_path else []
    args += ["--no-cache"] if no_cache else []
    args += ["--prometheus", prometheus_url] if prometheus_url else []
    for o in overrides:
        args += ["--set", o]
    meta = {"stalwart_name": "chaos", "stalwart_run_dir": run_dir}
    job = None
    try:
        job = jobs.submit_command(submission_id, shlex.join(args), meta, wd, {}, [])
        make_console(stderr=True).print(
            f"stalwart chaos: running on {jobs.address} as {submission_id}", highlight=False
        )
        for line in user_lines(jobs.follow(job)):
            click.echo(line)
        job = jobs.get(submission_id)
        if junit_path:
            with tempfile.TemporaryDirectory() as tmp:
                jobs.fetch(job, Path(tmp))
                Path(junit_path).write_bytes((Path(tmp) / "junit.xml").read_bytes())
    except KeyboardInterrupt:
        if job is not None:
            jobs.stop(job)
        sys.exit(EXIT_CANCELLED)
    except (JobsError, OSError) as e:
        fail(str(e))
    sys.exit({"SUCCEEDED": 0, "STOPPED": EXIT_CANCELLED}.get(job.status, EXIT_FAILED))

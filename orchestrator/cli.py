"""The `stalwart` command line."""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import time
from importlib import resources
from pathlib import Path

import click
from rich.console import Console

from stalwart.orchestrator.cli_conventions import (
    EXIT_CANCELLED,
    EXIT_FAILED,
    EXIT_USAGE,
    check_entrypoint,
    check_fits,
    discard_if_empty,
    fail,
    format_option,
    job_supervisor,
    load_job,
    make_console,
    new_dirs,
    result_exit_code,
    run_dir_option,
    set_option,
    spec_dir,
)
from stalwart.orchestrator.cli_jobs import auth_options, jobs_logs, jobs_status
from stalwart.orchestrator.compat import UnsupportedDependency
from stalwart.orchestrator.jobs import RESULT_PREFIX, STATUS_PREFIX

STATUS_WATCH_S = 1.0  # how often `stalwart status --watch` asks
# What a summary of a run's result.json reads (observe/progress.py print_summary).
RESULT_KEYS = (
    "name",
    "status",
    "steps_completed",
    "total_steps",
    "final_loss",
    "wall_seconds",
    "goodput",
    "failures",
    "lost_steps_total",
)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="stalwart")
def main() -> None:
    """stalwart: fault-tolerant PyTorch training on Ray."""


_set_option = set_option


def _cancel_on_sigterm(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


class _StatusRecords:
    """For a submitted job (`--status-every S`): the progress snapshot, at most every S
    seconds and at each state change, and the result at the end, as one-line records in the
    job's log, which `stalwart status ID` reads through the Jobs API."""

    def __init__(self, every_s: float | None):
        self.every_s = every_s
        self._last = 0.0
        self._state: str | None = None

    def progress(self, p: dict, _events: list) -> None:
        if self.every_s is None:
            return
        now = time.monotonic()
        if now - self._last >= self.every_s or p.get("state") != self._state:
            self._last, self._state = now, p.get("state")
            self._emit(STATUS_PREFIX, p)

    def result(self, result: dict) -> None:
        if self.every_s is not None:
            self._emit(RESULT_PREFIX, result)

    @staticmethod
    def _emit(prefix: str, record: dict) -> None:
        # On a line of its own, whatever the progress view left on the current one.
        sys.__stdout__.write("\n" + prefix + json.dumps(record, separators=(",", ":")) + "\n")
        sys.__stdout__.flush()


def _resume_value(value: str) -> str:
    if value in ("auto", "never") or (value.isdigit() and int(value) >= 0):
        return value
    raise click.BadParameter(f"expected auto, never or a step number, got {value!r}")


@main.command()
@click.argument("file", type=click.Path(dir_okay=False, allow_dash=True))
@_set_option
@click.option(
    "--address",
    envvar="RAY_ADDRESS",
    default=None,
    help="Ray cluster: ray://HOST:10001, HOST:6379 or auto (default: RAY_ADDRESS, "
    "else an embedded local Ray)",
)
@run_dir_option("the run directory: result.json, events.jsonl, logs/ (default runs/NAME-TIME)")
@format_option("json: print result.json to stdout")
@click.option("--num-cpus", type=int, default=None, help="logical CPUs of the embedded Ray")
@click.option(
    "--resume",
    default="auto",
    show_default=True,
    callback=lambda _ctx, _param, v: _resume_value(v),
    help="with checkpoint.persist.uri: auto resumes from the newest valid durable "
    "checkpoint of this job (same name), never starts over, STEP resumes from that step",
)
@click.option(
    "--all-ranks",
    is_flag=True,
    help="show every rank's printed lines live (default: rank 0's; all are kept under "
    "RUN_DIR/logs/)",
)
@click.option(
    "--allow-remote",
    is_flag=True,
    help="allow the spec's chaos faults on a cluster this command did not start (the spec "
    "must also say chaos.enabled: true)",
)
# `stalwart submit`'s entrypoint on the cluster: where relative entrypoints are found, and
# the status records `stalwart status ID` reads from the job's log.
@click.option("--base-dir", default=None, hidden=True)
@click.option("--status-every", type=float, default=None, hidden=True)
def run(
    file: str,
    overrides: tuple[str, ...],
    address: str | None,
    run_dir: str | None,
    fmt: str,
    num_cpus: int | None,
    resume: str,
    all_ranks: bool = False,
    allow_remote: bool = False,
    base_dir: str | None = None,
    status_every: float | None = None,
) -> None:
    """Train the job in FILE, recovering from failures, and print a summary. This process
    drives the job (Ctrl-C cancels it); `stalwart submit` runs it on a cluster instead."""
    from stalwart.orchestrator.driver import (
        ChaosRefused,
        ClusterUnreachable,
        JobAlreadyRunning,
        RunOptions,
        SupervisorLost,
        run_job,
    )
    from stalwart.orchestrator.jobs import is_jobs_address
    from stalwart.orchestrator.observe.progress import ProgressView, print_summary

    err = Console(stderr=True)
    if is_jobs_address(address):
        fail(
            f"--address {address}: that is a Jobs API; `stalwart submit FILE --address ...` "
            "sends the job there (it trains on whether or not this machine stays connected); "
            "`stalwart run` drives a job from here through ray://HEAD:10001 or HEAD:6379"
        )
    spec = load_job(file, overrides, err)
    base_dir = str(Path(base_dir).resolve()) if base_dir is not None else spec_dir(file)
    # On this machine's embedded Ray the workers import exactly what we can: check it now.
    # A remote cluster may have the code where we do not (its image, a runtime_env); there
    # the workers report an entrypoint that does not import.
    if not address:
        check_entrypoint(spec, file, err, base_dir)
        check_fits(spec, file, None, num_cpus, err)
    default_dir = Path("runs") / f"{spec.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    out = Path(run_dir).expanduser() if run_dir else default_dir
    created = new_dirs(out)  # removed again if the job never starts
    opts = RunOptions(
        address=address,
        output=out,
        base_dir=base_dir,
        num_cpus=num_cpus,
        resume=resume,
        allow_remote_chaos=allow_remote,
    )
    console = make_console(stderr=fmt == "json")
    records = _StatusRecords(status_every)

    def connected(gcs: str) -> None:
        # `kill PID` (and Ray's stop of a submitted job) cancels as Ctrl-C does: cleanly.
        # Installed once connected: ray.init puts in a SIGTERM handler of its own that exits.
        signal.signal(signal.SIGTERM, _cancel_on_sigterm)
        err.print(
            f"stalwart: {spec.name} runs on the Ray at {gcs}; from another terminal: "
            f"stalwart status {spec.name} -w",
            highlight=False,
            soft_wrap=True,
        )

    try:
        if fmt == "json":
            # stdout is for the JSON alone: Ray prints some messages of its own there (a
            # worker's death: "(raylet) A worker died ..."), from its threads, meanwhile.
            with contextlib.redirect_stdout(sys.stderr):
                result = run_job(spec, opts, on_progress=records.progress, on_connected=connected)
        else:
            console.print(
                f"stalwart: running {spec.name} ({spec.max_workers} workers, "
                f"{spec.steps} steps) -> {out}",
                highlight=False,
            )
            with ProgressView(console, spec.name) as view:

                def progress(p: dict, events: list) -> None:
                    view.update(p, events)
                    records.progress(p, events)

                result = run_job(
                    spec,
                    opts,
                    on_progress=progress,
                    on_output=lambda lines: view.output(lines, all_ranks),
                    on_connected=connected,
                )
    except (ClusterUnreachable, JobAlreadyRunning, UnsupportedDependency, ChaosRefused) as e:
        discard_if_empty(created)  # a job that never started leaves no empty run directory
        fail(str(e), EXIT_USAGE)
    except SupervisorLost as e:
        err.print(f"[red]error:[/red] {e}", highlight=False, soft_wrap=True)
        sys.exit(EXIT_FAILED)
    records.result(result)
    if fmt == "json":
        click.echo(json.dumps(result, indent=2))
    else:
        print_summary(console, result)
    sys.exit(result_exit_code(result["status"]))


@main.command()
@_set_option
@run_dir_option(
    "the run directory: result.json, events.jsonl, logs/ (default runs/quickstart-TIME)"
)
@format_option("json: print result.json to stdout")
@click.option("--num-cpus", type=int, default=None, help="logical CPUs of the embedded Ray")
@click.option(
    "--show", is_flag=True, help="print the quickstart's job spec (a starting point) and exit"
)
@click.pass_context
def quickstart(
    ctx: click.Context,
    overrides: tuple[str, ...],
    run_dir: str | None,
    fmt: str,
    num_cpus: int | None,
    show: bool,
) -> None:
    """Train the packaged quickstart on an embedded local Ray: a small GPT on 4 workers, rank 1
    killed at step 60 and recovered from the in-memory checkpoint. Runs from any directory."""
    spec = resources.files("stalwart.examples").joinpath("quickstart.yaml")
    if show:
        click.echo(spec.read_text(), nl=False)
        return
    with resources.as_file(spec) as path:
        ctx.invoke(
            run,
            file=str(path),
            overrides=overrides,
            address=None,
            run_dir=run_dir,
            fmt=fmt,
            num_cpus=num_cpus,
            resume="auto",
        )


@main.command()
@click.argument("job")
@click.option(
    "--address",
    envvar="RAY_ADDRESS",
    default=None,
    help="the cluster the job runs on: http://HEAD:8265 (its Jobs API, for a submitted job), "
    "ray://HEAD:10001 or HEAD:6379 (default: $RAY_ADDRESS, else the cluster `stalwart run` "
    "on this machine started the job on)",
)
@auth_options
@format_option("json: print the job's progress snapshot (or result.json) as JSON")
@click.option(
    "-w",
    "--watch",
    is_flag=True,
    help="keep updating until the job ends (Ctrl-C stops watching, not the job)",
)
@click.option(
    "--fetch",
    type=click.Path(file_okay=False),
    default=None,
    help="a submitted job: copy its run directory from the cluster into DIR",
)
def status(
    job: str,
    address: str | None,
    headers: tuple[str, ...],
    token_file: str | None,
    fmt: str,
    watch: bool,
    fetch: str | None,
) -> None:
    """Show JOB's state, step, steps/s, goodput, failures and slowest ranks. JOB is a
    submitted job's id or name (with a Jobs API --address), a running job's name, or a run
    directory (its result.json: the job has ended). Exit 0 running or succeeded, 1 failed,
    130 cancelled."""
    from rich.markup import escape

    from stalwart.orchestrator.jobs import is_jobs_address
    from stalwart.orchestrator.observe.progress import status_line

    err = Console(stderr=True)
    console = Console()
    if Path(job).is_dir():
        _status_of_run_dir(Path(job), fmt)
        return
    if is_jobs_address(address):
        jobs_status(job, address, headers, token_file, fmt, watch, fetch)
        return
    if fetch:
        fail(
            "--fetch copies a submitted job's run directory: give the cluster's Jobs API, "
            "--address http://HEAD:8265"
        )
    address = address or _registered_address(job)
    supervisor = job_supervisor(address, job, err)
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    try:
        while True:
            try:
                p = ray.get(supervisor.progress.remote(), timeout=30)
            except RayActorError:
                err.print(f"job {job} has ended (its supervisor is gone)", highlight=False)
                return
            except GetTimeoutError:
                err.print(
                    f"[red]error:[/red] job {escape(job)}'s supervisor did not answer within "
                    "30 s (it may be overloaded; try again)",
                    highlight=False,
                    soft_wrap=True,
                )
                sys.exit(EXIT_FAILED)
            if fmt == "json":
                click.echo(json.dumps(p))
            else:
                # A terminal gets one line of its width; a pipe or a file the whole line.
                width = console.width if console.is_terminal else 1000
                console.print(status_line(job, p, None, width), width=width)
            if not watch or p["state"] in ("SUCCEEDED", "FAILED", "CANCELLED"):
                sys.exit({"FAILED": EXIT_FAILED, "CANCELLED": EXIT_CANCELLED}.get(p["state"], 0))
            time.sleep(STATUS_WATCH_S)
    except KeyboardInterrupt:
        return
    finally:
        ray.shutdown()


def _registered_address(job: str) -> str:
    """The cluster `stalwart run` on this machine drives job `job` on; never another."""
    from stalwart.orchestrator import registry

    entry = registry.lookup(job)
    if entry is None:
        fail(
            f"no job named {job!r} is driven by `stalwart run` on this machine: give the "
            "cluster it runs on (--address http://HEAD:8265 for a submitted job, or "
            "ray://HEAD:10001), or a run directory"
        )
    return entry["address"]


def _status_of_run_dir(run_dir: Path, fmt: str) -> None:
    """A run directory's result.json: its summary; exit 1 if the run failed, 130 cancelled."""
    from stalwart.orchestrator.observe.progress import print_summary

    result_file = run_dir / "result.json"
    try:
        result = json.loads(result_file.read_text())
    except FileNotFoundError:
        fail(
            f"{result_file}: not found: the run has not ended (follow a running job by name: "
            "stalwart status NAME)"
        )
    except (OSError, ValueError) as e:
        fail(f"{result_file}: expected the JSON result of a run: {e}")
    missing = [] if not isinstance(result, dict) else [k for k in RESULT_KEYS if k not in result]
    if not isinstance(result, dict) or missing:
        what = ", ".join(missing) if isinstance(result, dict) else "an object"
        fail(f"{result_file}: not the result of a stalwart run (missing: {what})")
    if fmt == "json":
        click.echo(json.dumps(result, indent=2))
    else:
        try:
            print_summary(make_console(), result)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            fail(f"{result_file}: not the result of a stalwart run (its {e} is not as expected)")
    sys.exit(result_exit_code(result["status"]))


@main.command()
@click.argument("run_dir", type=click.Path())
@run_dir_option("where to write the figures and index.html (default RUN_DIR/report)", "--out-dir")
@format_option("json: print the written files as a JSON list")
def report(run_dir: str, out_dir: str | None, fmt: str) -> None:
    """Render PNG figures and an HTML page from RUN_DIR's events.jsonl and result.json."""
    from rich.markup import escape

    from stalwart.orchestrator.observe.report import build_report
    from stalwart.orchestrator.observe.rundir import ReportError

    err = Console(stderr=True)
    try:
        written = build_report(run_dir, out_dir)
    except ReportError as e:
        err.print(f"[red]error:[/red] {escape(str(e))}", highlight=False, soft_wrap=True)
        sys.exit(EXIT_USAGE)
    for warning in written.warnings:
        err.print(f"warning: {warning}", highlight=False, markup=False, soft_wrap=True)
    if fmt == "json":
        click.echo(json.dumps([str(p) for p in written.files]))
    else:
        for path in written.files:
            click.echo(str(path))


@main.command()
@click.argument("node")
@click.option("--job", "job", required=True, help="the running job's name")
@click.option(
    "--address",
    envvar="RAY_ADDRESS",
    required=True,
    help="the Ray cluster the job runs on (default: $RAY_ADDRESS)",
)
def uncordon(node: str, job: str, address: str) -> None:
    """Let NODE (a Ray node id, or a unique prefix) take ranks of JOB again."""
    err = Console(stderr=True)
    supervisor = job_supervisor(address, job, err)
    import ray

    try:
        cordoned = ray.get(supervisor.cordoned.remote(), timeout=30)
        matches = [n for n in cordoned if n.startswith(node)]
        if len(matches) != 1:
            listed = ", ".join(n[:12] for n in cordoned) or "none"
            err.print(
                f"[red]error:[/red] node {node!r}: "
                + ("matches several cordoned nodes" if matches else "is not cordoned")
                + f" in job {job} (cordoned: {listed})",
                highlight=False,
                soft_wrap=True,
            )
            sys.exit(EXIT_USAGE)
        ray.get(supervisor.uncordon.remote(matches[0]), timeout=30)
        click.echo(f"uncordoned {matches[0]} for job {job}")
    finally:
        ray.shutdown()


@main.command()
@click.argument("job")
@click.option("--rank", type=int, default=None, help="one rank's lines (default: all, merged)")
@click.option("-f", "--follow", is_flag=True, help="keep printing lines as they are written")
@click.option(
    "--address",
    envvar="RAY_ADDRESS",
    default=None,
    help="a submitted job's cluster, its Jobs API: http://HEAD:8265 (default: $RAY_ADDRESS)",
)
@auth_options
def logs(
    job: str,
    rank: int | None,
    follow: bool,
    address: str | None,
    headers: tuple[str, ...],
    token_file: str | None,
) -> None:
    """Print what the ranks of a job printed, in time order. JOB is a run directory (its
    logs/), or a submitted job's id or name with the cluster's Jobs API --address."""
    from stalwart.orchestrator.jobs import is_jobs_address
    from stalwart.orchestrator.observe.logs import LogError, log_files, merged

    err = Console(stderr=True)
    if not Path(job).is_dir() and is_jobs_address(address):
        jobs_logs(job, address, headers, token_file, rank, follow)
        return
    run_dir = Path(job)
    try:
        paths = log_files(run_dir, rank)
    except LogError as e:
        err.print(f"[red]error:[/red] {e}", highlight=False, soft_wrap=True, markup=False)
        sys.exit(EXIT_USAGE)
    offsets: dict[Path, int] = {}
    try:
        while True:
            for line in merged(paths, offsets):
                click.echo(line)
            if not follow:
                return
            time.sleep(STATUS_WATCH_S)  # polling the files, as `tail -f` does
            if rank is None:
                paths = log_files(run_dir)  # a rank that printed its first line
    except KeyboardInterrupt:
        sys.exit(EXIT_CANCELLED)


from stalwart.orchestrator.cli_chaos import chaos as _chaos  # noqa: E402
from stalwart.orchestrator.cli_checkpoint import checkpoint as _checkpoint  # noqa: E402
from stalwart.orchestrator.cli_dashboards import dashboards as _dashboards  # noqa: E402
from stalwart.orchestrator.cli_jobs import fetch_run_dir as _fetch_run_dir  # noqa: E402
from stalwart.orchestrator.cli_jobs import list_jobs as _list_jobs  # noqa: E402
from stalwart.orchestrator.cli_jobs import stop as _stop  # noqa: E402
from stalwart.orchestrator.cli_jobs import submit as _submit  # noqa: E402
from stalwart.orchestrator.cli_simulate import simulate as _simulate  # noqa: E402
from stalwart.orchestrator.cli_spec import schema as _schema  # noqa: E402
from stalwart.orchestrator.cli_spec import validate as _validate  # noqa: E402
from stalwart.orchestrator.cli_verify import verify as _verify  # noqa: E402

main.add_command(_dashboards)
main.add_command(_verify)
main.add_command(_checkpoint)
main.add_command(_chaos)
main.add_command(_validate)
main.add_command(_schema)
main.add_command(_submit)
main.add_command(_stop)
main.add_command(_list_jobs)
main.add_command(_fetch_run_dir)
main.add_command(_simulate)


if __name__ == "__main__":
    main()

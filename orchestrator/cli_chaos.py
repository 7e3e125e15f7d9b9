"""`stalwart chaos run SCENARIO...`: run chaos scenarios (orchestrator/chaos/runner.py) and
print their verdicts; exit 0 when every one passes, 1 when one fails, 2 on bad input."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path

import click

from stalwart.orchestrator.cli_conventions import (
    EXIT_CANCELLED,
    EXIT_FAILED,
    EXIT_USAGE,
    discard_if_empty,
    fail,
    format_option,
    job_supervisor,
    make_console,
    new_dirs,
    run_dir_option,
)
from stalwart.orchestrator.cli_jobs import auth_options, remote_chaos_run
from stalwart.orchestrator.jobs import is_jobs_address


@click.group()
def chaos() -> None:
    """Inject failures and judge how the job survived them."""


@chaos.command("run")
@click.argument("scenarios", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option(
    "--set", "overrides", multiple=True, metavar="KEY=VALUE", help="override a scenario field"
)
@click.option(
    "--address",
    envvar="RAY_ADDRESS",
    default=None,
    help="Ray cluster: http://HEAD:8265 runs the scenarios there as a job of their own; "
    "ray://HEAD:10001 or HEAD:6379 drives them from here (default: RAY_ADDRESS, else the "
    "cluster the scenario describes, started and stopped by this command)",
)
@click.option(
    "--allow-remote",
    is_flag=True,
    help="allow faults on a cluster this command did not start (the job spec must also "
    "say chaos.enabled: true)",
)
@run_dir_option("where the runs, verdict.json and junit.xml go (default runs/chaos-TIME)")
@click.option(
    "--junit",
    "junit_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="also write every scenario's checks to this JUnit XML file",
)
@click.option("--no-cache", is_flag=True, help="run the failure-free baseline even if cached")
@click.option(
    "--prometheus",
    "prometheus_url",
    default=None,
    help="Prometheus URL: check the scenario's expected alerts fire",
)
@format_option("json: print the verdicts as JSON")
@auth_options
def run(
    scenarios: tuple[str, ...],
    overrides: tuple[str, ...],
    address: str | None,
    allow_remote: bool,
    headers: tuple[str, ...],
    token_file: str | None,
    run_dir: str | None,
    junit_path: str | None,
    no_cache: bool,
    prometheus_url: str | None,
    fmt: str,
) -> None:
    """Run each SCENARIO: its failure-free baseline, its chaos run, and a verdict (PASS or
    FAIL, with what each fault cost)."""
    from stalwart.orchestrator.chaos.netns import NetnsError
    from stalwart.orchestrator.chaos.ray_faults import RedisMissing
    from stalwart.orchestrator.chaos.render import junit, table
    from stalwart.orchestrator.chaos.runner import (
        BaselineFailed,
        ChaosOptions,
        ShmMountFailed,
        run_scenario,
    )
    from stalwart.orchestrator.chaos.scenario import job_specs, load_scenario
    from stalwart.orchestrator.compat import UnsupportedDependency
    from stalwart.orchestrator.driver import (
        ChaosRefused,
        ClusterUnreachable,
        JobAlreadyRunning,
        SupervisorLost,
    )
    from stalwart.orchestrator.spec import SpecError

    err = make_console(stderr=True)
    console = make_console(stderr=fmt == "json")
    loaded = []
    for path in scenarios:
        try:
            sc = load_scenario(path, list(overrides))
            job_specs(sc)  # every scenario's job and faults check out before any runs
        except SpecError as e:
            err.print(f"[red]error:[/red] invalid chaos scenario {e.source}", highlight=False)
            for line in e.errors:
                err.print(f"  {line}", highlight=False, markup=False, soft_wrap=True)
            sys.exit(EXIT_USAGE)
        loaded.append(sc)
    if is_jobs_address(address):  # a Jobs API: the scenarios run on the cluster itself
        if run_dir:
            fail("--run-dir: the runs of a chaos run on a Jobs API stay on the cluster")
        remote_chaos_run(
            scenarios,
            overrides,
            address,
            headers,
            token_file,
            allow_remote,
            junit_path,
            no_cache,
            prometheus_url,
            fmt,
        )
    root = (
        Path(run_dir).expanduser()
        if run_dir
        else Path("runs") / f"chaos-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    created = new_dirs(root)  # removed again if no scenario starts
    verdicts = []
    for sc in loaded:
        opts = ChaosOptions(
            output=root / sc.name if len(loaded) > 1 else root,
            address=address,
            allow_remote=allow_remote,
            base_dir=str(sc.source.parent),
            use_cache=not no_cache,
            prometheus_url=prometheus_url,
        )
        try:
            with contextlib.redirect_stdout(sys.stderr) if fmt == "json" else _nothing():
                v = run_scenario(
                    sc,
                    opts,
                    say=lambda m, n=sc.name: console.print(
                        f"stalwart chaos {n}: {m}", highlight=False, markup=False
                    ),
                )
        except KeyboardInterrupt:
            err.print("cancelled")
            sys.exit(EXIT_CANCELLED)
        except (ChaosRefused, ClusterUnreachable, JobAlreadyRunning, UnsupportedDependency) as e:
            discard_if_empty(created)
            fail(str(e), EXIT_USAGE)
        except (BaselineFailed, SupervisorLost, ShmMountFailed, NetnsError, RedisMissing) as e:
            err.print(f"[red]error:[/red] {e}", highlight=False, soft_wrap=True)
            sys.exit(EXIT_FAILED)
        verdicts.append(v)
        if fmt == "text":
            console.print(table(v))
    if junit_path:
        Path(junit_path).expanduser().write_text(junit(verdicts))
    if fmt == "json":
        click.echo(json.dumps([v.to_dict() for v in verdicts], indent=2))
    elif len(verdicts) > 1:
        passed = sum(v.passed for v in verdicts)
        console.print(f"{passed}/{len(verdicts)} scenarios passed", highlight=False)
    sys.exit(0 if all(v.passed for v in verdicts) else EXIT_FAILED)


@chaos.command("inject")
@click.argument("job")
@click.option("--kind", required=True, help="the fault: kill_worker, kill_node, hang, slow, ...")
@click.option("--rank", type=int, default=None, help="the rank it hits (default 0)")
@click.option("--node", default=None, help="the node it hits (an id or a unique prefix)")
@click.option(
    "--set",
    "fields",
    multiple=True,
    metavar="FIELD=VALUE",
    help="the kind's own fields: "
    "factor=4 (slow), xid=79 (gpu_xid), seconds=30 (storage_unavailable)",
)
@click.option(
    "--address",
    envvar="RAY_ADDRESS",
    default="auto",
    show_default=True,
    help="the Ray cluster the job runs on",
)
@click.option(
    "--allow-remote",
    is_flag=True,
    help="allow it on a cluster the job's command did not start (its spec must also say "
    "chaos.enabled: true)",
)
@format_option("json: print the fault as the job recorded it")
def inject(
    job: str,
    kind: str,
    rank: int | None,
    node: str | None,
    fields: tuple[str, ...],
    address: str,
    allow_remote: bool,
    fmt: str,
) -> None:
    """Inject a fault into running job JOB: carried out before its target rank's next
    step, and recorded in the job's event log with who asked."""
    import getpass
    import socket

    import ray
    import yaml

    err = make_console(stderr=True)
    if kind in ("partition", "loss", "delay", "flap"):
        # Done to the cluster's network, not by the job: only the process that started the
        # nodes in their namespaces can.
        fail(
            f"--kind {kind}: a fault of the network is carried out by `stalwart chaos run` on "
            "a cluster it starts with its nodes in network namespaces (a scenario with "
            "cluster: {network: netns}; docs/chaos.md), not injected into a running job",
            EXIT_USAGE,
        )
    request: dict = {"kind": kind, "rank": rank, "node": node, "allow_remote": allow_remote}
    for text in fields:
        key, sep, raw = text.partition("=")
        if not sep or not key:
            err.print(f"[red]error:[/red] --set: expected FIELD=VALUE, got {text!r}")
            sys.exit(EXIT_USAGE)
        request[key] = yaml.safe_load(raw)
    if rank is None:
        request.pop("rank")
    request["by"] = f"{getpass.getuser()}@{socket.gethostname()}"
    supervisor = job_supervisor(address, job, err)
    try:
        answer = ray.get(supervisor.inject.remote(request), timeout=30)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
        err.print(
            f"[red]error:[/red] job {job}'s supervisor did not answer: {str(e).splitlines()[0]}",
            highlight=False,
        )
        sys.exit(EXIT_FAILED)
    finally:
        ray.shutdown()
    if "error" in answer:
        later = " (it takes faults again once it is RUNNING)" if answer.get("retry") else ""
        err.print(f"[red]error:[/red] {answer['error']}{later}", highlight=False, soft_wrap=True)
        sys.exit(EXIT_USAGE)
    fault = answer["fault"]
    if fmt == "json":
        click.echo(json.dumps(fault, indent=2))
    else:
        click.echo(
            f"injected fault {fault['index']} ({fault['kind']}) into rank {fault['rank']} of "
            f"job {job}: it fires before step {fault['at_step']}"
        )


@contextlib.contextmanager
def _nothing():
    yield

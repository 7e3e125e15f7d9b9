"""What every `stalwart` subcommand shares (orchestrator/cli_conventions.py, docs/cli.md):
`-o/--output` is the output format everywhere, a spec may come from stdin, a bad input is
exit 2 with a one-screen error (never a traceback), a job that never started leaves no run
directory, and what goes to a pipe is not wrapped at 80 columns."""

from __future__ import annotations

import json
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from stalwart.orchestrator import driver
from stalwart.orchestrator.cli import main
from stalwart.orchestrator.cli_conventions import discard_if_empty, make_console, new_dirs

JOB = "name: job\nentrypoint: train.py:loop\nworkers: 2\nsteps: 10\n"


@pytest.fixture
def job(tmp_path, monkeypatch) -> Path:
    """A valid spec whose entrypoint imports, in a directory of its own (the cwd)."""
    (tmp_path / "train.py").write_text("def loop(ctx):\n    pass\n")
    path = tmp_path / "job.yaml"
    path.write_text(JOB)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return path


def _invoke(args: list[str], **kw):
    return CliRunner().invoke(main, args, catch_exceptions=False, **kw)


def _one_screen_error(result, code: int = 2, users_traceback: bool = False) -> str:
    """The error's text, after checking the exit code and that it is a short message (with
    no traceback but the last frames of the user's own code that failed to import)."""
    assert result.exit_code == code, result.output
    text = result.stderr
    assert text.startswith("error: "), text
    assert users_traceback or "Traceback" not in result.output
    assert len(text.splitlines()) < 25, text
    return text


def _commands(group: click.Group, prefix: str = ""):
    for name, cmd in group.commands.items():
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, f"{prefix}{name} ")
        else:
            yield f"{prefix}{name}", cmd


# --- -o/--output is the output format, in every subcommand ---------------------------------


def test_every_format_option_is_dash_o_output():
    with_format = []
    for name, cmd in _commands(main):
        for param in cmd.params:
            if param.name == "fmt":
                assert param.opts == ["-o", "--output"], name
                with_format.append(name)
            elif param.name != "fmt_old_name":
                assert "--output" not in param.opts and "-o" not in param.opts, name
    assert {"run", "validate", "report", "quickstart", "verify", "chaos run"} <= set(with_format)


def test_the_old_format_option_still_works_hidden(job):
    result = _invoke(["validate", str(job), "--output-format", "json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["name"] == "job"
    assert "--output-format" not in _invoke(["validate", "--help"]).stdout


@pytest.mark.parametrize(
    ("args", "hint"),
    [
        (["run", "job.yaml", "--output", "runs/x"], "a run directory is --run-dir runs/x"),
        (["report", "runs/x", "--output", "figs"], "a directory is --out-dir figs"),
        (["validate", "job.yaml", "-o", "yaml"], "-o/--output is the output format"),
    ],
)
def test_a_directory_given_as_output_says_which_option_takes_it(job, args, hint):
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2
    assert hint in result.stderr
    assert not Path("runs").exists()


# --- a spec from stdin -------------------------------------------------------------------


def test_validate_reads_the_spec_from_stdin(job):
    result = _invoke(["validate", "-"], input=JOB)
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("<stdin>: valid (2 workers, 10 steps")


def test_run_from_stdin_resolves_the_entrypoint_in_the_current_directory(job, monkeypatch):
    seen = {}

    def run_job(spec, opts, **_kw):
        seen["base_dir"] = opts.base_dir
        return {"name": spec.name, "status": "succeeded"}

    monkeypatch.setattr(driver, "run_job", run_job)
    result = _invoke(["run", "-", "-o", "json", "--run-dir", "out"], input=JOB)
    assert result.exit_code == 0, result.output
    assert seen["base_dir"] == str(job.parent)


def test_an_invalid_spec_from_stdin_names_stdin(job):
    text = _one_screen_error(_invoke(["validate", "-"], input=JOB + "steps: 5\n"))
    assert "invalid job spec <stdin>" in text
    assert "steps: duplicate key at line 5 (first at line 4)" in text


# --- a new user's mistakes: one screen each -----------------------------------------------


def test_a_spec_with_a_byte_that_is_not_utf8(job):
    job.write_bytes(b"name: j\xe9b\nentrypoint: train.py:loop\nworkers: 2\nsteps: 10\n")
    for command in ("validate", "run"):
        text = _one_screen_error(_invoke([command, str(job)]))
        assert f"invalid job spec {job}" in text
        assert "not UTF-8 text: byte 0xe9 at offset 7 (line 1, column 8)" in text


def test_duplicate_keys_are_refused_with_their_line(job):
    job.write_text(JOB + "checkpoint:\n  every_steps: 2\n  every_steps: 3\n")
    text = _one_screen_error(_invoke(["validate", str(job)]))
    assert "checkpoint.every_steps: duplicate key at line 7 (first at line 6)" in text


def test_steps_beyond_any_job_are_refused(job):
    text = _one_screen_error(_invoke(["validate", str(job), "--set", f"steps={10**29}"]))
    assert "steps: must be <= 1000000000000, got 100000000000000000000000000000" in text


def test_an_integer_beyond_int64_anywhere_is_refused(job):
    job.write_text(JOB + f"config: {{lr_steps: [1, {2**64}]}}\n")
    text = _one_screen_error(_invoke(["validate", str(job)]))
    assert "config.lr_steps.1: 18446744073709551616 is too large" in text


def test_validate_checks_the_entrypoint_imports(job):
    (job.parent / "train.py").write_text("import no_such_module_here\n")
    text = _one_screen_error(_invoke(["validate", str(job)]), users_traceback=True)
    assert f"{job}: entrypoint" in text
    assert "no_such_module_here" in text


@pytest.mark.parametrize("command", ["validate", "run"])
def test_more_workers_than_this_machine_holds(job, command, monkeypatch):
    monkeypatch.setattr(driver, "run_job", lambda *a, **k: pytest.fail("the job was started"))
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    text = _one_screen_error(_invoke([command, str(job), "--set", "workers=400"]))
    assert f"{job}: the job does not fit this machine" in text
    assert "workers: 400 workers are 400 processes, more than this machine's 4 CPU cores" in text
    assert not Path("runs").exists()


def test_validate_against_an_unreachable_cluster(job):
    text = _one_screen_error(_invoke(["validate", str(job), "--address", "127.0.0.1:1"]))
    assert "cannot reach the Ray cluster at 127.0.0.1:1" in text


def test_validate_against_a_cluster_too_small(job, monkeypatch):
    import ray

    node = {"Alive": True, "Resources": {"CPU": 8.0}}
    monkeypatch.setattr(driver, "connect", lambda *a: "ray://head:10001")
    monkeypatch.setattr(ray, "nodes", lambda: [node, node])
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    ok = _invoke(["validate", str(job), "--address", "ray://head:10001", "--set", "workers=16"])
    assert ok.exit_code == 0, ok.output
    assert "fits the cluster at ray://head:10001" in ok.stdout
    result = _invoke(["validate", str(job), "--address", "ray://head:10001", "--set", "workers=17"])
    text = _one_screen_error(result)
    assert "does not fit the Ray cluster at ray://head:10001" in text
    assert "resources.cpu: the job needs 17 CPU (17 workers x 1), the cluster has 16" in text


# --- a job that never started leaves no run directory --------------------------------------


def _unreachable(spec, opts, **_kw):
    # What driver.run_job did before connecting: the run directory and an empty log.
    Path(opts.output).mkdir(parents=True)
    (Path(opts.output) / "events.jsonl").write_text("")
    raise driver.ClusterUnreachable("cannot reach the Ray cluster at 10.0.0.1:6379: timed out")


def test_a_failed_connection_leaves_no_empty_run_directory(job, monkeypatch):
    monkeypatch.setattr(driver, "run_job", _unreachable)
    result = _invoke(["run", str(job), "--address", "10.0.0.1:6379", "--run-dir", "a/b/run"])
    text = _one_screen_error(result)
    assert "cannot reach the Ray cluster at 10.0.0.1:6379" in text
    assert not Path("a").exists()
    result = _invoke(["run", str(job), "--address", "10.0.0.1:6379"])  # default runs/NAME-TIME
    _one_screen_error(result)
    assert not Path("runs").exists()


def test_discard_keeps_what_existed_or_holds_bytes(tmp_path):
    existing = tmp_path / "existing"
    existing.mkdir()
    assert new_dirs(existing) is None
    discard_if_empty(new_dirs(existing))
    assert existing.is_dir()
    top = new_dirs(tmp_path / "x" / "y")
    assert top == tmp_path / "x"
    (tmp_path / "x" / "y").mkdir(parents=True)
    (tmp_path / "x" / "y" / "events.jsonl").write_text('{"kind": "x"}\n')
    discard_if_empty(top)
    assert (tmp_path / "x" / "y" / "events.jsonl").is_file()


# --- no wrapping at 80 columns on a pipe ---------------------------------------------------


def test_a_console_to_a_pipe_does_not_wrap(monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)

    @click.command()
    def cmd():
        make_console().print("word " * 60)

    result = CliRunner().invoke(cmd)
    assert result.stdout.strip() == ("word " * 60).strip()


def test_runs_summary_to_a_pipe_keeps_its_lines(job, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    result = {
        "name": "job",
        "status": "succeeded",
        "steps_completed": 10,
        "total_steps": 10,
        "steps_per_second": 12.5,
        "samples_per_second": 400.0,
        "wall_seconds": 3.0,
        "failures": [],
        "lost_steps_total": 0,
        "output": "out",
    }
    monkeypatch.setattr(driver, "run_job", lambda spec, opts, **kw: result)
    out = _invoke(["run", str(job), "--run-dir", "out"]).stdout
    assert "job: starting\n" in out  # the live line ends before the summary begins
    assert "stalwart: job succeeded" in out.splitlines()
    (line,) = [x for x in out.splitlines() if "throughput" in x]
    assert line.rstrip().endswith(
        "(all steps over the time since training began, recoveries included)"
    )


def test_a_network_fault_is_not_injected_into_a_running_job():
    """partition, loss, delay and flap are done to a cluster's network by `stalwart chaos
    run` on nodes it started in namespaces: `chaos inject` says so, exit 2, before it
    looks for any cluster."""
    for kind in ("partition", "loss", "delay", "flap"):
        result = CliRunner().invoke(
            main, ["chaos", "inject", "j", "--kind", kind, "--rank", "1", "--address", "x:1"]
        )
        assert result.exit_code == 2, result.output
        assert f"--kind {kind}: a fault of the network is carried out by" in result.output

"""orchestrator/worker/zygote.py: a worker's process forked from its node's zygote, without
Ray: the launcher runs a script where Ray would run default_worker.py, a sleeping process
stands in for the raylet. The component and chaos tests run every job's workers this way."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stalwart.orchestrator.spec import validate
from stalwart.orchestrator.worker import zygote
from tests.component.conftest import small_spec
from tests.unit.test_chaos import wait_until

pytestmark = pytest.mark.timeout(120)

SCRIPT = """
import json, os, sys
print(json.dumps({
    "pid": os.getpid(), "ppid": os.getppid(), "pgid": os.getpgid(0), "argv": sys.argv[1:],
    "cwd": os.getcwd(),
    "env": os.environ.get("STALWART_TEST_VALUE"), "torch_imported": "torch" in sys.modules,
    "extra_on_path": os.environ["EXTRA_PATH"] in sys.path,
}), flush=True)
if "--wait" in sys.argv:
    sys.stdin.readline()
sys.exit(3)
"""


@pytest.fixture
def node(tmp_path):
    """A stand-in raylet (a sleeping process and a socket path that exists) and the
    environment a worker of it gets; the zygote it leaves is stopped."""
    raylet = subprocess.Popen(["sleep", "300"])
    sock = tmp_path / "raylet.sock"
    sock.touch()
    script = tmp_path / "worker.py"
    script.write_text(SCRIPT)
    env = {
        **os.environ,
        "RAY_RAYLET_PID": str(raylet.pid),
        "STALWART_TEST_VALUE": "given",
        "EXTRA_PATH": str(tmp_path / "extra"),
        "PYTHONPATH": os.pathsep.join(
            [str(tmp_path / "extra"), *filter(None, [os.environ.get("PYTHONPATH")])]
        ),
    }
    yield raylet, sock, script, env
    raylet.kill()
    raylet.wait(timeout=10)
    for pid in zygote.zygotes_of(raylet.pid):
        os.kill(pid, signal.SIGKILL)


def _launch(script, sock, env, *extra, **kwargs):
    return subprocess.Popen(
        [sys.executable, "-m", zygote.MODULE, str(script), f"--raylet-name={sock}", *extra],
        env=env,
        cwd=script.parent,
        stdout=subprocess.PIPE,
        text=True,
        **kwargs,
    )


def test_a_worker_runs_forked_from_the_zygote_with_the_launchers_args_env_and_streams(node):
    raylet, sock, script, env = node
    for _ in range(2):  # the first starts the zygote, the second finds it
        proc = _launch(script, sock, env, "x")
        out, _ = proc.communicate(timeout=90)
        seen = json.loads(out)
        assert proc.returncode == 3  # the worker's exit status, through the launcher
        [forks] = zygote.zygotes_of(raylet.pid)
        assert seen["ppid"] == forks and seen["pid"] != proc.pid
        # Its own process group, as Ray gives a worker: the raylet kills a dead worker's.
        assert seen["pgid"] == seen["pid"]
        assert seen["argv"] == [f"--raylet-name={sock}", "x"] and seen["cwd"] == str(script.parent)
        assert seen["env"] == "given" and seen["extra_on_path"]
        assert seen["torch_imported"]  # imported once, by the zygote, before the fork


def test_either_process_dying_takes_the_other_down(node):
    _, sock, script, env = node
    # The worker killed (by Ray, by chaos): the launcher exits as killed by the same signal.
    proc = _launch(script, sock, env, "--wait", stdin=subprocess.PIPE)
    child = json.loads(proc.stdout.readline())["pid"]
    os.kill(child, signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    # The launcher killed (the raylet's handle on the worker): the worker exits too.
    proc = _launch(script, sock, env, "--wait", stdin=subprocess.PIPE)
    child = json.loads(proc.stdout.readline())["pid"]
    proc.kill()
    proc.wait(timeout=30)
    assert wait_until(lambda: not Path(f"/proc/{child}").exists() or _zombie(child), bool, 60)


def _zombie(pid: int) -> bool:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return text[text.rindex(")") + 2] == "Z"


def test_the_zygote_exits_with_its_raylet(node):
    raylet, sock, script, env = node
    proc = _launch(script, sock, env)
    proc.communicate(timeout=90)
    [forks] = zygote.zygotes_of(raylet.pid)
    raylet.kill()
    raylet.wait(timeout=10)
    assert wait_until(lambda: not Path(f"/proc/{forks}").exists() or _zombie(forks), bool, 30)


def test_one_zygote_per_raylet_and_environment():
    argv = ["default_worker.py", "--raylet-name=/tmp/ray/session/sockets/raylet"]
    env = {"PATH": "/bin", "RAY_JOB_ID": "01000000"}
    path = zygote.socket_path(argv, env)
    assert len(path) < 100  # a Unix socket's path
    # In a directory only this user may enter.
    st = os.lstat(os.path.dirname(path))
    assert st.st_uid == os.getuid() and st.st_mode & 0o777 == 0o700
    # The job's id differs between workers and no import reads it: the same zygote.
    assert zygote.socket_path(argv, {**env, "RAY_JOB_ID": "02000000"}) == path
    assert zygote.socket_path(argv, {**env, "OMP_NUM_THREADS": "2"}) != path
    other = ["default_worker.py", "--raylet-name=/tmp/ray/session/sockets/raylet.1"]
    assert zygote.socket_path(other, env) != path


def test_cpu_jobs_fork_gpu_jobs_and_jobs_with_a_runtime_env_spawn():
    def method(**changes):
        return zygote.start_method(validate(small_spec(**changes)))

    forks, reason = method()
    assert forks and "zygote" in reason
    forks, reason = method(resources__gpu=1)
    assert not forks and "GPU" in reason
    assert method(resources__gpu=1, resources__start_method="fork")[0]
    forks, reason = method(resources__start_method="spawn")
    assert not forks and "spawn" in reason
    forks, reason = method(runtime_env={"env_vars": {"A": "1"}})
    assert not forks and "runtime_env" in reason
    assert zygote.command().split() == [sys.executable, "-m", zygote.MODULE]


def test_a_zygote_that_cannot_start_leaves_the_worker_to_start_itself(node, tmp_path):
    # A torch that fails to import, first on the path: the zygote exits with the error in
    # its log, and the launcher runs the worker in its own process at once.
    _, sock, script, env = node
    broken = tmp_path / "broken"
    (broken / "torch").mkdir(parents=True)
    (broken / "torch" / "__init__.py").write_text("raise ImportError('a broken torch')\n")
    env = {**env, "PYTHONPATH": os.pathsep.join([str(broken), env["PYTHONPATH"]])}
    started = time.monotonic()
    proc = _launch(script, sock, env)
    out, _ = proc.communicate(timeout=90)
    seen = json.loads(out)
    assert proc.returncode == 3 and seen["pid"] == proc.pid and not seen["torch_imported"]
    assert time.monotonic() - started < zygote.START_WAIT_S
    log = Path(zygote.socket_path([str(script), f"--raylet-name={sock}"], env) + ".log")
    assert "a broken torch" in log.read_text()


def test_a_socket_directory_others_may_enter_is_refused(monkeypatch, tmp_path):
    monkeypatch.setattr(zygote.tempfile, "gettempdir", lambda: str(tmp_path))
    shared = tmp_path / f"stalwart-{os.getuid()}"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    with pytest.raises(PermissionError, match="not a directory of this user's alone"):
        zygote.private_dir()
    shared.chmod(0o700)
    assert zygote.private_dir() == str(shared)

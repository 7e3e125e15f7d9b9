"""A stalwart job on a Ray cluster's Jobs API (`stalwart submit`, and `status`, `logs`, `stop`,
`list` given an http(s) address): the driver, `stalwart run`, runs on the cluster as the job's
entrypoint, so the laptop that submitted it can go away.

What the laptop sees of a running job comes back through the job's log: the driver prints a
`STALWART_STATUS {json}` line (its progress snapshot) every STATUS_EVERY_S seconds and a
`STALWART_RESULT {json}` line (result.json) at the end; `status` reads the newest, `logs`
leaves them out. A run directory comes back on request (`fetch`) through a short second job
on the head that archives it into its own log.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import logging
import os
import re
import shlex
import tarfile
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stalwart.orchestrator.compat import RAY_MIN
from stalwart.orchestrator.job_logs import (  # noqa: F401 (re-exported)
    RESULT_PREFIX,
    STATUS_PREFIX,
    newest_status,
    parse_status,
    stream,
    tail,
)

ARCHIVE_PREFIX = "STALWART_ARCHIVE "
STATUS_EVERY_S = 5.0
TOKEN_ENV = "STALWART_RAY_TOKEN"  # a bearer token for a cluster behind a proxy
HEADERS_ENV = "RAY_JOB_HEADERS"  # Ray's own: a JSON object of extra HTTP headers
MARK = "stalwart"  # the submission metadata key that says a job is stalwart's
# Ray stops a job by signalling its entrypoint, then kills it this long after: room for the
# supervisor to abort the workers and for result.json to be written (driver.CANCEL_WAIT_S).
STOP_WAIT_S = 45
DEFAULT_EXCLUDES = [".git", ".venv", "venv", "__pycache__", "runs/", "*.egg-info", ".*_cache"]
FETCH_MAX_BYTES = 256 * 1024 * 1024
TIMEOUT_S = 10.0
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


class JobsError(Exception):
    """A mistake of the caller's or an address that is not a usable Ray cluster (exit 2)."""


class JobNotFound(JobsError):
    pass


class Secret:
    """A token that never shows itself: repr and str name only where it came from."""

    __slots__ = ("_value", "source")

    def __init__(self, value: str, source: str):
        value = value.strip()
        if not value or any(c.isspace() for c in value) or not value.isprintable():
            raise JobsError(f"{source}: expected one token (no whitespace), got something else")
        self._value, self.source = value, source

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return f"Secret(from {self.source}, redacted)"

    __str__ = __repr__

    def __reduce__(self):
        raise TypeError("a Secret is not pickled")


def read_secret(token_file: str | None, environ: Mapping[str, str] | None = None) -> Secret | None:
    """The bearer token from `token_file`, else from $STALWART_RAY_TOKEN, else None."""
    environ = os.environ if environ is None else environ
    if token_file:
        try:
            return Secret(Path(token_file).read_text(encoding="utf-8"), f"token file {token_file}")
        except (OSError, UnicodeDecodeError) as e:
            why = getattr(e, "strerror", None) or type(e).__name__
            raise JobsError(f"token file {token_file}: cannot read it ({why})") from None
    if environ.get(TOKEN_ENV):
        return Secret(environ[TOKEN_ENV], TOKEN_ENV)
    return None


def parse_headers(
    values: tuple[str, ...], environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """`--header 'Name: value'` (repeatable) over $RAY_JOB_HEADERS (a JSON object)."""
    environ = os.environ if environ is None else environ
    headers: dict[str, str] = {}
    if environ.get(HEADERS_ENV):
        try:
            loaded = json.loads(environ[HEADERS_ENV])
        except ValueError:
            loaded = None
        if not isinstance(loaded, dict) or not all(isinstance(v, str) for v in loaded.values()):
            raise JobsError(f"${HEADERS_ENV}: expected a JSON object of header names to strings")
        headers.update(loaded)
    for value in values:
        name, sep, rest = value.partition(":")
        if not sep or not name.strip() or not re.fullmatch(r"[A-Za-z0-9-]+", name.strip()):
            raise JobsError(f"--header {name.strip()!r}...: expected 'Name: value'")
        headers[name.strip()] = rest.strip()
    return headers


def is_jobs_address(address: str | None) -> bool:
    """An address of a Ray dashboard (the Jobs API): http:// or https://."""
    return bool(address) and address.startswith(("http://", "https://"))


@dataclass(frozen=True)
class Job:
    submission_id: str
    name: str
    status: str  # Ray's: PENDING, RUNNING, STOPPED, SUCCEEDED, FAILED
    message: str | None
    start_time: float | None  # seconds
    end_time: float | None
    run_dir: str | None
    driver_node: str | None = None  # the node its driver runs on (its log is there)

    @classmethod
    def of(cls, details: Any) -> Job:
        meta = details.metadata or {}
        return cls(
            submission_id=details.submission_id,
            name=meta.get("stalwart_name", ""),
            status=str(getattr(details.status, "value", details.status)),
            message=details.message,
            start_time=details.start_time / 1000 if details.start_time else None,
            end_time=details.end_time / 1000 if details.end_time else None,
            run_dir=meta.get("stalwart_run_dir"),
            driver_node=getattr(details, "driver_node_id", None),
        )

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class Jobs:
    """One Ray cluster's Jobs API, checked on connect: reachable, a Ray dashboard, a Ray
    version stalwart supports, credentials accepted."""

    def __init__(
        self,
        address: str,
        headers: dict[str, str] | None = None,
        token: Secret | None = None,
        timeout_s: float = TIMEOUT_S,
    ):
        self.address = address.rstrip("/")
        self._headers = dict(headers or {})
        if token is not None:
            self._headers["Authorization"] = f"Bearer {token.reveal()}"
        elif not any(k.lower() == "authorization" for k in self._headers):
            self._headers.update(_ray_auth_headers())
        self.ray_version = self._probe(timeout_s)
        from ray.job_submission import JobSubmissionClient

        try:
            self._client = JobSubmissionClient(self.address, headers=self._headers)
        except (ConnectionError, RuntimeError) as e:
            raise JobsError(f"{self.address}: the Jobs API did not accept us: {e}") from None

    def __repr__(self) -> str:  # never the headers: they may hold a token
        return f"Jobs({self.address})"

    def _probe(self, timeout_s: float) -> str:
        import requests

        url = f"{self.address}/api/version"
        try:
            r = requests.get(url, headers=self._headers, timeout=timeout_s)
        except requests.exceptions.Timeout:
            why = f"no answer within {timeout_s:g} s"
            raise JobsError(f"cannot reach the Ray dashboard at {self.address}: {why}") from None
        except requests.exceptions.RequestException as e:
            why = _root_cause(e)
            raise JobsError(f"cannot reach the Ray dashboard at {self.address}: {why}") from None
        if r.status_code in (401, 403):
            raise JobsError(
                f"{self.address} refused the credentials (HTTP {r.status_code}): check the token "
                f"(--token-file or ${TOKEN_ENV}) or the --header values"
            )
        try:
            version = r.json()["ray_version"] if r.ok else None
        except (ValueError, KeyError, TypeError):
            version = None
        if not isinstance(version, str):
            raise JobsError(
                f"{self.address} is not a Ray dashboard: GET /api/version answered HTTP "
                f"{r.status_code} without a Ray version (the Jobs API is the head's dashboard "
                "port, 8265 by default: --address http://HEAD:8265)"
            )
        if _version(version) < RAY_MIN:
            least = ".".join(map(str, RAY_MIN))
            raise JobsError(
                f"{self.address} runs Ray {version}; stalwart needs Ray >= {least} on the cluster"
            )
        return version

    # -- submission -----------------------------------------------------------------------

    def submit(
        self,
        spec_text: str,
        name: str,
        working_dir: Path,
        base_dir: str,
        runtime_env: dict[str, Any],
        excludes: list[str],
        run_dir: str | None = None,
        resume: str = "auto",
        allow_remote: bool = False,
    ) -> Job:
        """Upload `working_dir` and start `stalwart run` on the cluster with the spec (its
        validated text); the job's id."""
        submission_id = f"stalwart-{name}-{uuid.uuid4().hex[:8]}"
        run_dir = run_dir or f"~/stalwart-runs/{submission_id}"  # the driver's home
        args = ["run", "-", "--base-dir", base_dir, "--run-dir", run_dir, "--resume", resume]
        args += ["--all-ranks", "--status-every", f"{STATUS_EVERY_S:g}"]
        if allow_remote:
            args.append("--allow-remote")
        return self.submit_command(
            submission_id,
            'printf %s "$STALWART_JOB_SPEC" | ' + shlex.join(["stalwart", *args]),
            {"stalwart_name": name, "stalwart_run_dir": run_dir},
            working_dir,
            {
                **runtime_env,
                "env_vars": {**runtime_env.get("env_vars", {}), "STALWART_JOB_SPEC": spec_text},
            },
            excludes,
        )

    def submit_command(
        self,
        submission_id: str,
        entrypoint: str,
        metadata: dict[str, str],
        working_dir: Path,
        runtime_env: dict[str, Any],
        excludes: list[str],
    ) -> Job:
        """Upload `working_dir` (refused first if over Ray's limit) and run `entrypoint`, a
        `stalwart` command, there as the job `submission_id`."""
        excludes = DEFAULT_EXCLUDES + excludes + list(runtime_env.get("excludes", []))
        check_upload_size(working_dir, excludes)
        env = {**runtime_env, "working_dir": str(working_dir.resolve()), "excludes": excludes}
        env["env_vars"] = {
            **env.get("env_vars", {}),
            "RAY_JOB_STOP_SIGNAL": "SIGTERM",
            "RAY_JOB_STOP_WAIT_TIME_S": str(STOP_WAIT_S),
        }
        try:
            with _quiet_ray():  # its packaging notes, one per ignore file found
                self._client.submit_job(
                    entrypoint=entrypoint,
                    submission_id=submission_id,
                    runtime_env=env,
                    metadata={MARK: "1", **metadata},
                )
        except (RuntimeError, ValueError, ConnectionError) as e:
            raise JobsError(f"{self.address}: the job was not accepted: {_first_line(e)}") from None
        return self.get(submission_id)

    # -- following ------------------------------------------------------------------------

    def list(self) -> list[Job]:
        """stalwart's jobs on the cluster, newest first."""
        jobs = [Job.of(d) for d in self._call(self._client.list_jobs) if _is_ours(d)]
        return sorted(jobs, key=lambda j: j.start_time or 0, reverse=True)

    def find(self, job: str) -> Job:
        """A job by its submission id, or by its name (the running one, else the newest)."""
        jobs = self.list()
        for j in jobs:
            if j.submission_id == job:
                return j
        named = [j for j in jobs if j.name == job]
        if not named:
            raise JobNotFound(
                f"no stalwart job with the id or name {job!r} on {self.address} "
                "(stalwart list shows them)"
            )
        running = [j for j in named if j.status not in TERMINAL]
        return (running or named)[0]

    def get(self, submission_id: str) -> Job:
        """The job of a known submission id, as it is now (one request, not a listing)."""
        return Job.of(self._call(self._client.get_job_info, submission_id))

    def state(self, job: Job) -> str:
        """Ray's state of the job now: PENDING, RUNNING, STOPPED, SUCCEEDED, FAILED."""
        return self._status(job.submission_id)

    def logs(self, job: Job) -> str:
        return self._call(self._client.get_job_logs, job.submission_id)

    def follow(self, job: Job, poll_s: float = 1.0) -> Iterator[str]:
        """The job's log lines as they are written, until it ends: streamed (each byte
        read once), or, if the stream breaks, polled from where it got to."""
        sent = 0
        try:
            for line in stream(self._client, job.submission_id):
                sent += len(line) + 1
                yield line
            return
        except (RuntimeError, OSError):
            pass  # a proxy without websockets, a dropped connection: poll from `sent`
        while True:
            done = self.state(job) in TERMINAL
            text = self.logs(job)
            # A line still being written waits for its newline (or for the end).
            end = len(text) if done else text.rfind("\n") + 1
            if end > sent:
                yield from text[sent:end].splitlines()
                sent = end
            if done:
                return
            time.sleep(poll_s)  # the Jobs API has no push for logs over plain HTTP

    def stop(self, job: Job) -> bool:
        """Ask the cluster to stop the job (its driver cancels cleanly); False if it had
        already ended."""
        return bool(self._call(self._client.stop_job, job.submission_id))

    def status(self, job: Job) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """The newest progress snapshot the driver printed, and its result (once it ended),
        from the log's tail (job_logs.py)."""
        sid, node = job.submission_id, job.driver_node
        if node is None:  # not known when it was listed (pending then): ask again
            node = self.get(sid).driver_node
        return newest_status(
            lambda n: tail(self.address, self._headers, sid, node, n, TIMEOUT_S) if node else None,
            lambda: self.logs(job),
        )

    def fetch(self, job: Job, into: Path, timeout_s: float = 120.0) -> list[Path]:
        """Copy the job's run directory (on the head) into `into`."""
        if not job.run_dir:
            raise JobsError(f"job {job.submission_id} names no run directory")
        fetch_id = f"stalwart-fetch-{uuid.uuid4().hex[:8]}"
        cmd = shlex.join(["stalwart", "fetch-run-dir", job.run_dir])
        self._call(
            self._client.submit_job,
            entrypoint=cmd,
            submission_id=fetch_id,
            metadata={"stalwart_fetch": job.submission_id},
        )
        deadline = time.monotonic() + timeout_s
        while (status := self._status(fetch_id)) not in TERMINAL:
            if time.monotonic() > deadline:
                self._call(self._client.stop_job, fetch_id)
                raise JobsError(f"fetching {job.run_dir} took over {timeout_s:g} s")
            time.sleep(0.5)  # polling the fetch job, bounded by the deadline
        text = self._call(self._client.get_job_logs, fetch_id)
        self._call(self._client.delete_job, fetch_id)
        if status != "SUCCEEDED":
            raise JobsError(f"fetching {job.run_dir} failed on the cluster: {text.strip()[-300:]}")
        return unpack_archive(text, into)

    def _status(self, submission_id: str) -> str:
        status = self._call(self._client.get_job_status, submission_id)
        return str(getattr(status, "value", status))

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (RuntimeError, ConnectionError) as e:
            raise JobsError(f"{self.address}: {_first_line(e)}") from None


def user_lines(lines: Iterator[str] | list[str], rank: int | None = None) -> Iterator[str]:
    """The log's lines without stalwart's status records; with `rank`, only that rank's
    printed lines (`[rank R gen G] ...`)."""
    prefix = None if rank is None else re.compile(rf"^\[rank {rank} gen \d+\] ")
    for line in lines:
        if line.startswith((STATUS_PREFIX, RESULT_PREFIX)):
            continue
        if prefix is None or prefix.match(line):
            yield line


def archive_lines(run_dir: Path, max_bytes: int = FETCH_MAX_BYTES) -> Iterator[str]:
    """`run_dir` as a gzip'd tar, base64 in lines (the fetch job's output)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        # Files and folders only: a link would point at the head node's own files.
        tar.add(run_dir, arcname=".", filter=lambda m: m if m.isfile() or m.isdir() else None)
    data = buf.getvalue()
    if len(data) > max_bytes:
        raise JobsError(
            f"{run_dir}: {len(data) >> 20} MiB packed, over the {max_bytes >> 20} MiB a fetch "
            "carries; copy it from the head node instead"
        )
    text = base64.b64encode(data).decode()
    for i in range(0, len(text), 16384):
        yield ARCHIVE_PREFIX + text[i : i + 16384]


def unpack_archive(text: str, into: Path) -> list[Path]:
    chunks = [
        ln[len(ARCHIVE_PREFIX) :] for ln in text.splitlines() if ln.startswith(ARCHIVE_PREFIX)
    ]
    if not chunks:
        raise JobsError("the fetch job printed no archive (is the run directory there?)")
    into.mkdir(parents=True, exist_ok=True)
    try:
        data = base64.b64decode("".join(chunks))
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            tar.extractall(into, filter="data")  # no links out, no devices, no absolute paths
            return [into / m.name for m in tar.getmembers() if m.isfile()]
    except (ValueError, tarfile.TarError, OSError) as e:
        raise JobsError(f"the run directory's archive did not unpack into {into}: {e}") from None


def check_upload_size(working_dir: Path, excludes: list[str]) -> None:
    """Zip the working directory as Ray will upload it (.gitignore and .rayignore respected,
    plus `excludes`) and refuse it, before any upload, when it is over Ray's limit."""
    from ray._private.runtime_env import packaging

    if not working_dir.is_dir():
        raise JobsError(f"working directory {working_dir}: not a directory")
    with tempfile.TemporaryDirectory(prefix="stalwart-upload-") as tmp, _quiet_ray():
        path = Path(tmp) / "working_dir.zip"  # Ray writes a package only where none is
        packaging.create_package(str(working_dir), path, include_gitignore=True, excludes=excludes)
        size = path.stat().st_size
    limit = packaging.GCS_STORAGE_MAX_SIZE
    if size >= limit:
        raise JobsError(
            f"working directory {working_dir}: {size / 2**20:.1f} MiB zipped, over Ray's "
            f"{limit / 2**20:.1f} MiB upload limit; leave large files out with .gitignore, "
            ".rayignore or --exclude PATTERN (data and checkpoints belong in storage)"
        )


@contextlib.contextmanager
def _quiet_ray() -> Iterator[None]:
    """Ray's INFO and WARNING notes off for a while (its loggers set their own levels)."""
    loggers = [logging.getLogger("ray")] + [
        logging.getLogger(n) for n in list(logging.root.manager.loggerDict) if n.startswith("ray.")
    ]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def _ray_auth_headers() -> dict[str, str]:
    """Ray's own token (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token) where its
    token authentication is on, as Ray's own job client sends it."""
    try:
        from ray._private.authentication import authentication_token_setup as setup
        from ray._private.authentication.http_token_authentication import (
            get_auth_headers_if_auth_enabled,
        )
    except ImportError:  # a Ray without token authentication
        return {}
    quiet = logging.getLogger(setup.__name__)
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # its "token authentication is enabled" notice
    try:
        setup.maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
        return dict(get_auth_headers_if_auth_enabled({}))
    except Exception:  # no usable token: the cluster says so if it wants one
        return {}
    finally:
        quiet.setLevel(level)


def _is_ours(details: Any) -> bool:
    return (details.metadata or {}).get(MARK) == "1" and bool(details.submission_id)


def _version(text: str) -> tuple[int, ...]:
    m = re.match(r"(\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]


def _root_cause(e: BaseException) -> str:
    while e.__context__ is not None or e.__cause__ is not None:
        e = e.__cause__ or e.__context__
    return getattr(e, "strerror", None) or _first_line(e)

"""`stalwart dashboards export|push` (dashboards/provision.py, dashboards/grafana_api.py,
orchestrator/cli_dashboards.py).

There is no Grafana here: `push` talks to a small fake on 127.0.0.1 that implements the
endpoints grafana-client calls for it (GET /api/frontend/settings, GET /api/datasources,
GET and POST /api/folders, POST /api/dashboards/db), with Grafana's answers, status codes and
Bearer-token check; anything else is a 404 the tests fail on. The token is distinctive, and
every test that can show it checks it is absent from stdout, stderr, exceptions and logs."""

from __future__ import annotations

import json
import logging
import pickle
import re
import secrets
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from stalwart.dashboards import grafana_api
from stalwart.dashboards.provision import (
    PROVISIONING_FILE,
    ConfigError,
    GrafanaError,
    Token,
    export,
    push,
    read_token,
)
from stalwart.orchestrator.cli_dashboards import dashboards as cli

pytestmark = pytest.mark.timeout(30)

REPO = Path(__file__).resolve().parents[2]
COMMITTED = REPO / "dashboards" / "grafana"
UIDS = {
    "stalwart-job-overview",
    "stalwart-workers",
    "stalwart-checkpoints",
    "stalwart-nodes",
}
PROMETHEUS = {
    "id": 1,
    "uid": "prom-main",
    "orgId": 1,
    "name": "Prometheus",
    "type": "prometheus",
    "access": "proxy",
    "url": "http://127.0.0.1:9090",
    "isDefault": True,
}
THANOS = {**PROMETHEUS, "id": 2, "uid": "thanos-1", "name": "Thanos", "isDefault": False}
LOKI = {**PROMETHEUS, "id": 3, "uid": "loki-1", "name": "Loki", "type": "loki", "isDefault": False}


def _secret() -> str:
    return "glsa_stalwartTEST_" + secrets.token_hex(16)


class FakeGrafana:
    """Grafana's HTTP API as far as `push` uses it. State is plain attributes the tests set
    before pushing and read after."""

    def __init__(self, token: str):
        self.token = token
        self.prefix = ""  # serve under a sub path, like a Grafana behind /grafana/
        self.datasources: list[dict[str, Any]] = [PROMETHEUS]
        self.folders: dict[str, dict[str, Any]] = {}
        self.dashboards: dict[str, dict[str, Any]] = {}
        self.uploads: list[dict[str, Any]] = []
        self.requests: list[tuple[str, str]] = []
        self.unexpected: list[tuple[str, str]] = []
        self.settings_body: tuple[str, bytes] | None = None  # (content type, body) override
        self.datasources_forbidden = False  # Grafana < 9.4: only admins list datasources
        self.read_only = False  # a Viewer's token: every write is a 403
        self.provisioned = False  # the dashboards are file-provisioned there: saving is a 400
        self.hide_folders_once = False  # a concurrent push creates the folder under our feet
        self.broken = False  # Grafana failing itself: every save is an HTTP 500
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    def __enter__(self) -> FakeGrafana:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def calls(self) -> set[tuple[str, str]]:
        return set(self.requests)

    # --- the API -----------------------------------------------------------------------

    def handle(self, method: str, path: str, auth: str | None, body: Any) -> tuple[int, Any]:
        if not path.startswith(self.prefix + "/api/"):
            return 404, {"message": "Not found"}
        path = path[len(self.prefix) :].split("?")[0]
        self.requests.append((method, path))
        if auth != f"Bearer {self.token}":
            return 401, {"message": "Invalid API key", "messageId": "api-key.invalid"}
        writes = method in ("POST", "PUT", "DELETE")
        if writes and self.read_only:
            return 403, {"message": "You'll need additional permissions to perform this action."}
        route = (method, path)
        if route == ("GET", "/api/frontend/settings"):
            default = next((d["name"] for d in self.datasources if d.get("isDefault")), None)
            return 200, {
                "buildInfo": {"version": "11.3.0", "edition": "Open Source"},
                "defaultDatasource": default,
                "datasources": {
                    "-- Grafana --": {
                        "type": "datasource",
                        "uid": "grafana",
                        "name": "-- Grafana --",
                    },
                    **{
                        d["name"]: {k: d[k] for k in ("uid", "name", "type", "isDefault")}
                        for d in self.datasources
                    },
                },
            }
        if route == ("GET", "/api/datasources"):
            if self.datasources_forbidden:
                return 403, {
                    "message": "You'll need additional permissions to perform this action."
                }
            return 200, list(self.datasources)
        if route == ("GET", "/api/folders"):
            if self.hide_folders_once:
                self.hide_folders_once = False
                self.folders["stalwart"] = {"id": 7, "uid": "stalwart", "title": "stalwart"}
                return 200, []
            return 200, list(self.folders.values())
        if route == ("POST", "/api/folders"):
            if any(f["uid"] == body.get("uid") for f in self.folders.values()):
                return 409, {"message": "a folder with the same uid already exists"}
            if any(f["title"] == body["title"] for f in self.folders.values()):
                return 409, {"message": "a folder with the same name already exists"}
            uid = body.get("uid") or secrets.token_hex(4)
            folder = {"id": len(self.folders) + 1, "uid": uid, "title": body["title"]}
            self.folders[uid] = folder
            return 200, {**folder, "url": f"/dashboards/f/{uid}/", "version": 1}
        if route == ("POST", "/api/dashboards/db"):
            return self._save(body)
        self.unexpected.append(route)
        return 404, {"message": "Not found"}

    def _save(self, body: dict[str, Any]) -> tuple[int, Any]:
        self.uploads.append(body)
        board = body["dashboard"]
        if self.broken:
            return 500, {"message": "database is locked"}
        if self.provisioned:
            return 400, {"message": "Cannot save provisioned dashboard"}
        if body.get("folderUid") not in self.folders:
            return 400, {"message": "folder not found"}
        uid = board["uid"]
        if uid in self.dashboards and not body.get("overwrite"):
            return 412, {"status": "version-mismatch", "message": "The dashboard has been changed"}
        version = self.dashboards[uid]["version"] + 1 if uid in self.dashboards else 1
        self.dashboards[uid] = {
            "dashboard": board,
            "folderUid": body["folderUid"],
            "version": version,
        }
        slug = re.sub(r"[^a-z0-9]+", "-", board["title"].lower()).strip("-")
        return 200, {
            "id": list(self.dashboards).index(uid) + 1,
            "uid": uid,
            "url": f"{self.prefix}/d/{uid}/{slug}",
            "status": "success",
            "version": version,
            "slug": slug,
            "folderUid": body["folderUid"],
        }

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # headers and body go out at once

            def _serve(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                body = json.loads(raw) if raw else None
                with fake._lock:
                    if self.path.endswith("/api/frontend/settings") and fake.settings_body:
                        ctype, data = fake.settings_body
                        fake.requests.append((self.command, "/api/frontend/settings"))
                        status = 200
                    else:
                        status, answer = fake.handle(
                            self.command, self.path, self.headers.get("Authorization"), body
                        )
                        ctype, data = "application/json", json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_DELETE = _serve

            def log_message(self, *args: Any) -> None:
                pass

        return Handler


@pytest.fixture
def token() -> str:
    return _secret()


@pytest.fixture
def grafana(token):
    with FakeGrafana(token) as fake:
        yield fake
    assert not fake.unexpected, (
        f"push called endpoints the fake does not implement: {fake.unexpected}"
    )


def _invoke(args: list[str], env: dict[str, str | None] | None = None):
    base = {"GRAFANA_TOKEN": None, "GRAFANA_URL": None}
    return CliRunner().invoke(cli, args, env={**base, **(env or {})}, catch_exceptions=False)


def _committed() -> dict[str, dict[str, Any]]:
    boards = (json.loads(p.read_text()) for p in sorted(COMMITTED.glob("*.json")))
    return {b["uid"]: b for b in boards}


def _datasource_var(board: dict[str, Any]) -> dict[str, Any]:
    return next(v for v in board["templating"]["list"] if v["name"] == "datasource")


def _assert_hidden(secret: str, *texts: str) -> None:
    for text in texts:
        assert secret not in text


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


# --- export -------------------------------------------------------------------------------


def test_export_writes_the_committed_json_and_a_provisioning_file(tmp_path):
    out = tmp_path / "graf" / "stalwart"
    result = _invoke(["export", str(out)])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [*(p.name for p in COMMITTED.glob("*.json")), PROVISIONING_FILE]
    )
    for committed in COMMITTED.glob("*.json"):
        assert (out / committed.name).read_text() == committed.read_text()
    config = yaml.safe_load((out / PROVISIONING_FILE).read_text())
    assert config["apiVersion"] == 1
    [provider] = config["providers"]
    assert provider["type"] == "file"
    assert provider["folder"] == "stalwart"
    assert provider["folderUid"] == "stalwart"
    assert provider["allowUiUpdates"] is False
    assert provider["options"]["path"] == str(out.resolve())
    assert Path(provider["options"]["path"]).is_absolute()
    assert str(out / PROVISIONING_FILE) in result.stdout
    # Exporting again replaces the files in place.
    assert _invoke(["export", str(out)]).exit_code == 0
    assert len(list(out.iterdir())) == 5


def test_export_json_output_and_grafana_path(tmp_path):
    result = _invoke(
        [
            "export",
            str(tmp_path),
            "--grafana-path",
            "/var/lib/grafana/dashboards/stalwart",
            "--folder",
            "ML training",
            "-o",
            "json",
        ]
    )
    assert result.exit_code == 0, result.output
    done = json.loads(result.stdout)
    assert done["grafana_path"] == "/var/lib/grafana/dashboards/stalwart"
    assert len(done["dashboards"]) == 4
    config = yaml.safe_load(Path(done["provisioning"]).read_text())
    [provider] = config["providers"]
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards/stalwart"
    assert (provider["folder"], provider["folderUid"]) == ("ML training", "ml-training")


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--grafana-path", "dashboards/stalwart"], "expected an absolute path"),
        (["--folder", "  "], "folder: expected a Grafana folder title"),
    ],
)
def test_export_rejects_bad_options(tmp_path, args, expected):
    result = _invoke(["export", str(tmp_path / "out"), *args])
    assert result.exit_code == 2
    assert result.stderr.startswith("error:")
    assert expected in result.stderr


def test_export_into_a_file_is_a_usage_error(tmp_path):
    target = tmp_path / "taken"
    target.write_text("")
    result = _invoke(["export", str(target)])
    assert result.exit_code == 2
    assert result.stderr.startswith("error:")


# --- push ---------------------------------------------------------------------------------


def test_push_creates_the_folder_and_uploads_the_four_dashboards(grafana, token, caplog):
    caplog.set_level(logging.DEBUG)
    result = _invoke(["push", "--grafana-url", grafana.url], env={"GRAFANA_TOKEN": token})
    assert result.exit_code == 0, result.output
    assert grafana.folders == {"stalwart": {"id": 1, "uid": "stalwart", "title": "stalwart"}}
    assert {u["dashboard"]["uid"] for u in grafana.uploads} == UIDS
    assert len(grafana.uploads) == 4
    committed = _committed()
    for upload in grafana.uploads:
        assert upload["overwrite"] is True
        assert upload["folderUid"] == "stalwart"
        board = upload["dashboard"]
        assert _datasource_var(board)["current"] == {
            "selected": True,
            "text": "Prometheus",
            "value": "prom-main",
        }
        # Apart from the variable's default (and no numeric id), the committed JSON.
        expected = json.loads(json.dumps(committed[board["uid"]]))
        _datasource_var(expected)["current"] = _datasource_var(board)["current"]
        assert {**board, "id": None} == {**expected, "id": None}
    assert grafana.calls() == {
        ("GET", "/api/frontend/settings"),
        ("GET", "/api/datasources"),
        ("GET", "/api/folders"),
        ("POST", "/api/folders"),
        ("POST", "/api/dashboards/db"),
    }
    assert "pushed 4 dashboards" in result.stdout
    assert f"{grafana.url}/d/stalwart-job-overview/" in result.stdout
    assert "folder stalwart (created" in result.stdout
    _assert_hidden(token, result.stdout, result.stderr, caplog.text)
    # The committed JSON keeps an empty default: the datasource is the uploaded copy's.
    for board in _committed().values():
        assert _datasource_var(board)["current"] == {}


def test_pushing_again_overwrites_by_uid(grafana, token):
    first = push(grafana.url, token)
    second = push(grafana.url, token)
    assert first.folder_created and not second.folder_created
    assert grafana.requests.count(("POST", "/api/folders")) == 1
    assert set(grafana.dashboards) == UIDS
    assert {d.uid: d.version for d in first.dashboards} == dict.fromkeys(UIDS, 1)
    assert {d.uid: d.version for d in second.dashboards} == dict.fromkeys(UIDS, 2)
    assert all(d["version"] == 2 for d in grafana.dashboards.values())


def test_push_json_output(grafana, token):
    result = _invoke(
        ["push", "--grafana-url", grafana.url + "/", "-o", "json"], env={"GRAFANA_TOKEN": token}
    )
    assert result.exit_code == 0, result.output
    done = json.loads(result.stdout)
    assert done["grafana_url"] == grafana.url
    assert done["grafana_version"] == "11.3.0"
    assert (done["folder_uid"], done["folder_title"], done["folder_created"]) == (
        "stalwart",
        "stalwart",
        True,
    )
    assert (done["datasource_name"], done["datasource_uid"]) == ("Prometheus", "prom-main")
    assert {d["uid"] for d in done["dashboards"]} == UIDS
    for d in done["dashboards"]:
        assert d["url"].startswith(f"{grafana.url}/d/{d['uid']}/")
        assert d["version"] == 1


def test_push_into_an_existing_folder_found_by_title(grafana, token):
    grafana.folders["abc123"] = {"id": 4, "uid": "abc123", "title": "Training"}
    result = push(grafana.url, token, folder="Training")
    assert (result.folder_uid, result.folder_created) == ("abc123", False)
    assert ("POST", "/api/folders") not in grafana.calls()
    assert {u["folderUid"] for u in grafana.uploads} == {"abc123"}


def test_a_folder_created_concurrently_is_used(grafana, token):
    grafana.hide_folders_once = True  # not listed, then POST /api/folders says 409
    result = push(grafana.url, token)
    assert (result.folder_uid, result.folder_created) == ("stalwart", False)
    assert len(grafana.dashboards) == 4


def test_push_to_a_grafana_under_a_sub_path(grafana, token):
    grafana.prefix = "/grafana"
    result = push(grafana.url + "/grafana/", token)
    assert result.grafana_url == grafana.url + "/grafana"
    assert all(d.url.startswith(f"{grafana.url}/grafana/d/") for d in result.dashboards)


@pytest.mark.parametrize(
    ("datasources", "wanted", "expected"),
    [
        ([LOKI, {**THANOS, "isDefault": True}, PROMETHEUS], None, "thanos-1"),  # the default
        ([LOKI, {**PROMETHEUS, "isDefault": False}, THANOS], None, "prom-main"),  # the first
        ([PROMETHEUS, THANOS], "Thanos", "thanos-1"),  # by name
        ([PROMETHEUS, THANOS], "thanos-1", "thanos-1"),  # by uid
    ],
)
def test_the_datasource_variable_defaults_to_the_chosen_datasource(
    grafana, token, datasources, wanted, expected
):
    grafana.datasources = datasources
    result = push(grafana.url, token, datasource=wanted)
    assert result.datasource_uid == expected
    for board in grafana.dashboards.values():
        assert _datasource_var(board["dashboard"])["current"]["value"] == expected


def test_datasources_from_frontend_settings_when_listing_is_forbidden(grafana, token):
    grafana.datasources_forbidden = True  # Grafana before 9.4 with an Editor token
    grafana.datasources = [LOKI, THANOS]
    result = push(grafana.url, token)
    assert result.datasource_name == "Thanos"
    assert len(grafana.dashboards) == 4


# --- push: what goes wrong ----------------------------------------------------------------


def test_a_rejected_token(grafana, token, caplog):
    caplog.set_level(logging.DEBUG)
    wrong = _secret()
    result = _invoke(["push", "--grafana-url", grafana.url], env={"GRAFANA_TOKEN": wrong})
    assert result.exit_code == 2  # bad input: a token refused
    assert result.stderr.startswith("error:")
    assert (
        f"Grafana at {grafana.url} rejected the token (HTTP 401 on GET /api/frontend/settings): "
        "check GRAFANA_TOKEN or --token-file"
    ) in result.stderr
    assert result.stdout == ""
    assert not grafana.folders and not grafana.uploads
    _assert_hidden(wrong, result.stdout, result.stderr, caplog.text)
    _assert_hidden(token, result.stdout, result.stderr, caplog.text)


def test_a_token_that_may_not_write(grafana, token):
    grafana.read_only = True  # a Viewer's service account
    with pytest.raises(GrafanaError) as info:
        push(grafana.url, token)
    message = str(info.value)
    assert info.value.status == 403
    assert f"Grafana at {grafana.url} rejected the token (HTTP 403 on POST /api/folders)" in message
    assert "Editor role" in message
    _assert_hidden(token, message, repr(info.value))


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        (lambda: f"http://127.0.0.1:{_closed_port()}", "connection refused"),
        (lambda: "http://grafana.invalid:3000", "cannot resolve the host name"),
    ],
    ids=["refused", "dns"],
)
def test_an_unreachable_grafana(token, url, reason):
    url = url()
    result = _invoke(["push", "--grafana-url", url, "--timeout", "5"], env={"GRAFANA_TOKEN": token})
    assert result.exit_code == 2  # bad input: an address that cannot be reached, as for Ray
    assert result.stderr.startswith(f"error: cannot reach Grafana at {url}: {reason}")
    _assert_hidden(token, result.stdout, result.stderr)


def test_a_grafana_that_does_not_answer(token):
    with socket.socket() as silent:  # accepts connections (the backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        with pytest.raises(GrafanaError) as info:
            push(url, token, timeout=0.5)
    assert str(info.value) == (
        f"cannot reach Grafana at {url}: no answer to GET /api/frontend/settings within 0.5 s"
    )


def test_no_prometheus_datasource(grafana, token):
    grafana.datasources = [LOKI]
    result = _invoke(["push", "--grafana-url", grafana.url], env={"GRAFANA_TOKEN": token})
    assert result.exit_code == 2  # the address is not what the dashboards need
    assert result.stderr.startswith(f"error: Grafana at {grafana.url} has no Prometheus datasource")
    assert "it has: Loki (loki, uid loki-1)" in result.stderr
    assert not grafana.folders and not grafana.uploads  # nothing written before the check


def test_a_named_datasource_that_is_missing(grafana, token):
    grafana.datasources = [PROMETHEUS, LOKI]
    result = _invoke(
        ["push", "--grafana-url", grafana.url, "--datasource", "Mimir"],
        env={"GRAFANA_TOKEN": token},
    )
    assert result.exit_code == 2
    assert f"Grafana at {grafana.url} has no datasource named 'Mimir'" in result.stderr
    assert "Prometheus (prometheus, uid prom-main), Loki (loki, uid loki-1)" in result.stderr
    assert not grafana.uploads


def test_a_grafana_that_fails_itself_is_exit_1(grafana, token):
    grafana.broken = True
    result = _invoke(["push", "--grafana-url", grafana.url], env={"GRAFANA_TOKEN": token})
    assert result.exit_code == 1  # the service failed (HTTP 5xx), not our input
    assert result.stderr.startswith(f"error: Grafana at {grafana.url} failed on POST")
    assert "HTTP 500" in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.splitlines()) < 25


def test_a_named_datasource_that_is_not_prometheus(grafana, token):
    grafana.datasources = [PROMETHEUS, LOKI]
    with pytest.raises(GrafanaError, match=r"datasource 'Loki' .* is of type 'loki', expected"):
        push(grafana.url, token, datasource="Loki")


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (("text/html", b"<html>Sign in</html>"), "with text, not JSON ('<html>Sign in</html>')"),
        (("application/json", b"{not json"), "with something that is not JSON"),
        (("application/json", b"[1, 2]"), "with a JSON array, expected a JSON object"),
    ],
    ids=["html", "broken-json", "wrong-shape"],
)
def test_an_answer_that_is_not_grafanas(grafana, token, body, expected):
    grafana.settings_body = body
    with pytest.raises(GrafanaError) as info:
        push(grafana.url, token)
    message = str(info.value)
    assert message.startswith(f"Grafana at {grafana.url} answered GET /api/frontend/settings")
    assert expected in message
    assert f"is {grafana.url} Grafana's root URL" in message


def test_dashboards_provisioned_from_files_cannot_be_pushed(grafana, token):
    grafana.provisioned = True
    with pytest.raises(GrafanaError) as info:
        push(grafana.url, token)
    message = str(info.value)
    assert "HTTP 400): Cannot save provisioned dashboard" in message
    assert "stalwart dashboards export" in message
    assert "(uploaded before this: none)" in message


# --- the token ----------------------------------------------------------------------------


def test_token_from_the_environment_and_from_a_file(grafana, token, tmp_path):
    token_file = tmp_path / "grafana-token"
    token_file.write_text(f"\n  {token}\n\n")
    by_file = _invoke(["push", "--grafana-url", grafana.url, "--token-file", str(token_file)])
    assert by_file.exit_code == 0, by_file.output
    # Both given: the file wins (the environment's token is wrong here).
    both = _invoke(
        ["push", "--grafana-url", grafana.url, "--token-file", str(token_file)],
        env={"GRAFANA_TOKEN": _secret()},
    )
    assert both.exit_code == 0, both.output
    by_env = _invoke(["push"], env={"GRAFANA_TOKEN": token, "GRAFANA_URL": grafana.url})
    assert by_env.exit_code == 0, by_env.output
    for result in (by_file, both, by_env):
        _assert_hidden(token, result.stdout, result.stderr)
    assert {d["version"] for d in grafana.dashboards.values()} == {3}


def test_no_token_is_a_usage_error(grafana):
    result = _invoke(["push", "--grafana-url", grafana.url])
    assert result.exit_code == 2
    assert result.stderr.startswith(
        "error: no Grafana token: set GRAFANA_TOKEN or pass --token-file"
    )
    assert not grafana.requests


def test_no_url_is_a_usage_error(token):
    result = _invoke(["push"], env={"GRAFANA_TOKEN": token})
    assert result.exit_code == 2
    assert result.stderr.startswith(
        "error: no Grafana URL: pass --grafana-url URL or set GRAFANA_URL"
    )


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (None, "no such file"),
        ("", "is empty, expected a Grafana service account token"),
        ("  \n", "is empty"),
        ("{token}\nsecond line\n", "holds more than a token"),
        ("Bearer {token}", "holds more than a token"),
        ("dir", "is a directory"),
    ],
    ids=["missing", "empty", "blank", "two-lines", "two-words", "directory"],
)
def test_a_bad_token_file_is_a_usage_error(grafana, token, tmp_path, content, expected):
    path = tmp_path / "token"
    if content == "dir":
        path.mkdir()
    elif content is not None:
        path.write_text(content.format(token=token))
    result = _invoke(
        ["push", "--grafana-url", grafana.url, "--token-file", str(path)],
        env={"GRAFANA_TOKEN": token},
    )
    assert result.exit_code == 2
    assert result.stderr.startswith(f"error: token file {path}: ")
    assert expected in result.stderr
    assert not grafana.requests
    _assert_hidden(token, result.stdout, result.stderr)


def test_an_unreadable_token_file(tmp_path, token, monkeypatch):
    path = tmp_path / "token"
    path.write_text(token)

    def denied(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_text", denied)  # chmod 0 does not stop root
    with pytest.raises(ConfigError) as info:
        read_token(str(path), {})
    assert str(info.value) == f"token file {path}: cannot read it (permission denied)"


def test_a_url_with_a_password_is_refused_without_echoing_it(token):
    result = _invoke(
        ["push", "--grafana-url", "http://admin:hunter2@127.0.0.1:3000"],
        env={"GRAFANA_TOKEN": token},
    )
    assert result.exit_code == 2
    assert "must not carry a user or password" in result.stderr
    assert "hunter2" not in result.output


@pytest.mark.parametrize("url", ["127.0.0.1:3000", "ftp://grafana", "http://", "http://h:99999"])
def test_a_malformed_url_is_a_usage_error(token, url):
    result = _invoke(["push", "--grafana-url", url], env={"GRAFANA_TOKEN": token})
    assert result.exit_code == 2
    assert result.stderr.startswith("error: Grafana URL")
    assert "expected http(s)://HOST[:PORT][/PATH]" in result.stderr


@pytest.mark.parametrize(
    "url",
    [
        "http://admin:hunter2@grafana:30x0",  # a bad port after a password
        "http://admin:hunter2@[::1",  # an unclosed IPv6 address after a password
        "http://grafana:3000/?auth=hunter2",
        "http://grafana:3000/#hunter2",
        "ftp://admin:hunter2@grafana",
    ],
)
def test_a_url_is_never_echoed_with_what_it_may_hide(token, url):
    result = _invoke(["push", "--grafana-url", url], env={"GRAFANA_TOKEN": token})
    assert result.exit_code == 2
    assert result.stderr.startswith("error: Grafana URL")
    assert "hunter2" not in result.stderr + result.stdout


def test_the_token_does_not_show_itself(token, tmp_path):
    held = read_token(None, {"GRAFANA_TOKEN": token})
    assert held.reveal() == token
    assert token not in repr(held) and token not in str(held) and token not in f"{held!r}"
    assert repr(held) == "Token(from GRAFANA_TOKEN, redacted)"
    auth = grafana_api._bearer_auth(held)
    assert token not in repr(auth)
    with pytest.raises(TypeError):
        pickle.dumps(held)
    token_file = tmp_path / "t"
    token_file.write_text(token)
    assert read_token(str(token_file), {"GRAFANA_TOKEN": "other"}).reveal() == token
    with pytest.raises(ConfigError, match="no Grafana token"):
        read_token(None, {})


def test_a_token_echoed_by_grafana_is_scrubbed(grafana, token):
    # A misbehaving proxy that quotes the request back must not leak the token either.
    grafana.settings_body = ("text/plain", f"forbidden: Authorization: Bearer {token}".encode())
    with pytest.raises(GrafanaError) as info:
        push(grafana.url, Token(token, "GRAFANA_TOKEN"))
    assert token not in str(info.value)
    assert "Bearer <token>" in str(info.value)


def test_stalwart_registers_the_dashboards_commands(grafana, token):
    from stalwart.orchestrator.cli import main

    result = CliRunner().invoke(
        main,
        ["dashboards", "push", "--grafana-url", grafana.url, "-o", "json"],
        env={"GRAFANA_TOKEN": token, "GRAFANA_URL": None},
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    assert len(json.loads(result.stdout)["dashboards"]) == 4
    _assert_hidden(token, result.stdout, result.stderr)


def test_export_function_matches_the_cli(tmp_path):
    done = export(tmp_path)
    assert done.grafana_path == str(tmp_path.resolve())
    assert {Path(p).name for p in done.dashboards} == {p.name for p in COMMITTED.glob("*.json")}

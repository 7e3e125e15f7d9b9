"""Getting the dashboards into a Grafana, two ways.

`export(DIR)` writes the four dashboards' JSON (exactly as committed in dashboards/grafana/)
and a Grafana file-provisioning YAML that points a `file` provider at DIR: for a Grafana whose
configuration you own (a container, a Helm chart).

`push(URL, token)` uploads them through Grafana's HTTP API with grafana-client: it checks the
Grafana answers and has a Prometheus datasource, makes sure the folder exists, and saves each
dashboard by uid with overwrite (pushing again replaces them; Grafana keeps the history). The
uploaded copies default their `datasource` variable to the chosen Prometheus datasource.

Only a token authenticates (a service account token with the Editor role), from GRAFANA_TOKEN
or a file. It never appears in a message, an exception or a repr: `Token` hides it, and every
message about a Grafana answer is scrubbed of it.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import socket
import ssl
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import yaml

from stalwart.dashboards.__main__ import render

FOLDER = "stalwart"
TOKEN_ENV = "GRAFANA_TOKEN"
PROVISIONING_FILE = "stalwart-dashboards.yaml"
DEFAULT_TIMEOUT_S = 10.0
UPDATE_INTERVAL_S = 30  # how often Grafana's file provider rescans the directory
_MAX_DETAIL = 200  # characters of a Grafana answer quoted in a message


class ProvisionError(Exception):
    """A provisioning step failed; the message says what, where, and what was expected."""


class ConfigError(ProvisionError):
    """Our side is wrong: the token, the URL, the export directory (CLI exit code 2)."""


class GrafanaError(ProvisionError):
    """Grafana is unreachable, refused the token, or lacks what the dashboards need (CLI exit
    code 2), or failed itself (HTTP 5xx: exit 1). `status` is the HTTP status when Grafana
    answered with one."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


# --- export -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Exported:
    directory: str
    dashboards: list[str]
    provisioning: str
    grafana_path: str
    folder: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def export(
    directory: str | os.PathLike[str], *, folder: str = FOLDER, grafana_path: str | None = None
) -> Exported:
    """Write the dashboards' JSON and `stalwart-dashboards.yaml` (a file provider for the
    folder `folder`) into `directory`. `grafana_path` is where Grafana will read the JSON
    files, when that is not `directory`'s own absolute path (a container mount, another host).
    Files are replaced atomically: a Grafana rescanning the directory never reads half a file.
    """
    folder = _check_folder(folder)
    out = Path(directory)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"export directory {out}: exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"export directory {out}: cannot create it ({e.strerror or e})") from e
    path = grafana_path if grafana_path is not None else str(out.resolve())
    if not path or not PurePosixPath(path).is_absolute():
        raise ConfigError(
            f"Grafana's path to the dashboards {path!r}: expected an absolute path "
            "(where Grafana reads the exported JSON files, e.g. /var/lib/grafana/dashboards/"
            "stalwart)"
        )
    written = []
    for name, text in render().items():
        _write_atomically(out / name, text)
        written.append(str(out / name))
    provisioning = out / PROVISIONING_FILE
    _write_atomically(provisioning, provisioning_yaml(path, folder))
    return Exported(
        directory=str(out),
        dashboards=written,
        provisioning=str(provisioning),
        grafana_path=path,
        folder=folder,
    )


def provisioning_yaml(path: str, folder: str = FOLDER) -> str:
    """Grafana's file-provisioning config (apiVersion 1) for the dashboards in `path`."""
    config = {
        "apiVersion": 1,
        "providers": [
            {
                "name": "stalwart",
                "orgId": 1,
                "folder": folder,
                "folderUid": folder_uid(folder),
                "type": "file",
                "disableDeletion": False,
                "allowUiUpdates": False,
                "updateIntervalSeconds": UPDATE_INTERVAL_S,
                "options": {"path": path, "foldersFromFilesStructure": False},
            }
        ],
    }
    header = f"""\
# Grafana file provisioning for stalwart's dashboards, written by `stalwart dashboards export`.
# Put this file in Grafana's provisioning/dashboards/ directory (by default
# /etc/grafana/provisioning/dashboards/); Grafana reads it when it starts.
#
# options.path is where Grafana finds the dashboards' JSON files: {path}
# If Grafana sees the export directory under another path (a container mount, another host),
# export again with --grafana-path PATH, or edit it below.
#
# allowUiUpdates is false: the dashboards are code (dashboards/definitions.py). Change them
# there, export again, and Grafana reloads changed files within {UPDATE_INTERVAL_S} s. Do not also
# `stalwart dashboards push` to this Grafana: it cannot overwrite provisioned dashboards.
"""
    return header + yaml.safe_dump(config, sort_keys=False, default_flow_style=False)


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")  # not *.json: Grafana's provider skips it
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise ConfigError(f"cannot write {path}: {e.strerror or e}") from e


# --- token --------------------------------------------------------------------------------


class Token:
    """A Grafana token that does not show itself: repr and str name only its source."""

    __slots__ = ("_value", "source")

    def __init__(self, value: str, source: str):
        value = value.strip()
        if not value:
            raise ConfigError(f"{source}: is empty, expected a Grafana service account token")
        if not (value.isascii() and value.isprintable()) or any(c.isspace() for c in value):
            raise ConfigError(
                f"{source}: holds more than a token (whitespace, several lines or characters "
                "a token cannot have): expected only a Grafana service account token"
            )
        self._value = value
        self.source = source

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return f"Token(from {self.source}, redacted)"

    __str__ = __repr__

    def __reduce__(self):
        raise TypeError("a Token is not pickled (it would write the secret out)")


def read_token(token_file: str | None, environ: Mapping[str, str] | None = None) -> Token:
    """The token from `token_file` (whitespace around it stripped) when given, else from
    GRAFANA_TOKEN. The file wins when both are there."""
    environ = os.environ if environ is None else environ
    if token_file is not None:
        source = f"token file {token_file}"
        try:
            text = Path(token_file).read_text(encoding="utf-8")
        except FileNotFoundError as e:
            raise ConfigError(
                f"{source}: no such file (expected a file holding a Grafana service account token)"
            ) from e
        except IsADirectoryError as e:
            raise ConfigError(f"{source}: is a directory, expected a file holding the token") from e
        except PermissionError as e:
            raise ConfigError(f"{source}: cannot read it (permission denied)") from e
        except UnicodeDecodeError:
            raise ConfigError(f"{source}: is not UTF-8 text, expected only the token") from None
        except OSError as e:
            raise ConfigError(f"{source}: cannot read it ({e.strerror or e})") from e
        return Token(text, source)
    if TOKEN_ENV in environ:
        return Token(environ[TOKEN_ENV], TOKEN_ENV)
    raise ConfigError(
        f"no Grafana token: set {TOKEN_ENV} or pass --token-file FILE (a service account "
        "token with the Editor role)"
    )


# --- push ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pushed:
    uid: str
    title: str
    url: str
    version: int | None


@dataclass(frozen=True)
class PushResult:
    grafana_url: str
    grafana_version: str | None
    folder_uid: str
    folder_title: str
    folder_created: bool
    datasource_uid: str
    datasource_name: str
    dashboards: list[Pushed]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def push(
    url: str,
    token: Token | str,
    folder: str = FOLDER,
    datasource: str | None = None,
    *,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> PushResult:
    """Upload the four dashboards to the Grafana at `url` into `folder` (created when missing,
    found by title or by its uid), overwriting by uid. `datasource` names the Prometheus
    datasource (name or uid) the dashboards default to; without it, the org's default
    datasource when it is Prometheus, else the first Prometheus one. Nothing is written to
    Grafana before the datasource check passed."""
    folder = _check_folder(folder)
    target = _Target.parse(url)
    if not isinstance(token, Token):
        token = Token(token, "the token")
    boards = [json.loads(text) for text in render().values()]
    try:
        import grafana_client  # noqa: F401
    except ModuleNotFoundError:
        raise ConfigError(
            "stalwart dashboards push talks to Grafana through grafana-client, which is not "
            "installed: pip install 'stalwart[grafana]'"
        ) from None
    grafana = _Grafana(target, token, timeout)
    try:
        settings = grafana.call("GET /api/frontend/settings", dict, grafana.frontend_settings)
        version = (settings.get("buildInfo") or {}).get("version")
        source = _pick_datasource(grafana, settings, datasource)
        fuid, ftitle, created = _ensure_folder(grafana, folder)
        pushed: list[Pushed] = []
        for board in boards:
            upload = copy.deepcopy(board)
            upload["id"] = None  # new or overwritten by uid, never by a numeric id
            _default_datasource(upload, source)
            payload = {
                "dashboard": upload,
                "folderUid": fuid,
                "overwrite": True,
                "message": "stalwart dashboards push",
            }
            try:
                saved = grafana.call(
                    f"POST /api/dashboards/db (dashboard {upload['uid']})",
                    dict,
                    grafana.api.dashboard.update_dashboard,
                    payload,
                    forbidden="save dashboards in that folder",
                )
            except GrafanaError as e:
                done = ", ".join(p.uid for p in pushed) or "none"
                raise GrafanaError(f"{e} (uploaded before this: {done})", e.status) from None
            pushed.append(
                Pushed(
                    uid=str(saved.get("uid") or upload["uid"]),
                    title=upload["title"],
                    url=target.link(saved.get("url")),
                    version=saved.get("version"),
                )
            )
    finally:
        grafana.close()
    return PushResult(
        grafana_url=target.display,
        grafana_version=version,
        folder_uid=fuid,
        folder_title=ftitle,
        folder_created=created,
        datasource_uid=str(source["uid"]),
        datasource_name=str(source["name"]),
        dashboards=pushed,
    )


def folder_uid(title: str) -> str:
    """The uid stalwart gives a folder it creates: the title, lower case, with anything but
    letters, digits, - and _ replaced (Grafana uids have at most 40 characters); a title
    with none of those gets a digest of itself."""
    uid = re.sub(r"[^a-z0-9_-]+", "-", title.lower()).strip("-")[:40].strip("-")
    return uid or "folder-" + hashlib.sha256(title.encode()).hexdigest()[:12]


def _check_folder(folder: str) -> str:
    folder = folder.strip()
    if not folder:
        raise ConfigError("folder: expected a Grafana folder title, got an empty one")
    return folder


def _pick_datasource(
    grafana: _Grafana, settings: dict[str, Any], wanted: str | None
) -> dict[str, Any]:
    try:
        sources = grafana.call(
            "GET /api/datasources",
            list,
            grafana.api.datasource.list_datasources,
            forbidden="list datasources",
        )
    except GrafanaError as e:
        # Before Grafana 9.4 only admins may list datasources; the frontend settings every
        # signed-in user gets carry the ones the token may query.
        listed = settings.get("datasources")
        if e.status != 403 or not isinstance(listed, dict):
            raise
        sources = [s for s in listed.values() if isinstance(s, dict) and s.get("uid")]
    sources = [s for s in sources if isinstance(s, dict)]
    default = settings.get("defaultDatasource")
    for s in sources:
        s.setdefault("isDefault", s.get("name") == default)
    have = (
        ", ".join(f"{s.get('name')} ({s.get('type')}, uid {s.get('uid')})" for s in sources)
        or "none"
    )
    where = grafana.target.display
    if wanted is not None:
        match = [s for s in sources if wanted in (s.get("name"), s.get("uid"))]
        if not match:
            raise GrafanaError(
                f"Grafana at {where} has no datasource named {wanted!r} (by name or uid); "
                f"it has: {have}"
            )
        if match[0].get("type") != "prometheus":
            raise GrafanaError(
                f"datasource {wanted!r} at {where} is of type {match[0].get('type')!r}, "
                f"expected prometheus; it has: {have}"
            )
        return match[0]
    prometheus = [s for s in sources if s.get("type") == "prometheus"]
    if not prometheus:
        raise GrafanaError(
            f"Grafana at {where} has no Prometheus datasource for the dashboards to query; "
            f"it has: {have}. Add one that reads the Prometheus scraping stalwart "
            "(dashboards/prometheus/scrape.yml), or name one with --datasource"
        )
    return next((s for s in prometheus if s.get("isDefault") is True), prometheus[0])


def _ensure_folder(grafana: _Grafana, title: str) -> tuple[str, str, bool]:
    """(uid, title, created): the folder titled `title`, else the one with our uid, else a
    new one. A concurrent push that created it first (HTTP 409/412) is fine."""
    uid = folder_uid(title)

    def find() -> dict[str, Any] | None:
        folders = grafana.call("GET /api/folders", list, grafana.api.folder.get_all_folders)
        folders = [f for f in folders if isinstance(f, dict)]
        return next((f for f in folders if f.get("title") == title), None) or next(
            (f for f in folders if f.get("uid") == uid), None
        )

    found = find()
    if found is not None:
        return str(found["uid"]), str(found.get("title", title)), False
    try:
        made = grafana.call(
            "POST /api/folders",
            dict,
            grafana.api.folder.create_folder,
            title,
            uid,
            forbidden="create folders",
        )
    except GrafanaError as e:
        if e.status in (409, 412) and (found := find()) is not None:
            return str(found["uid"]), str(found.get("title", title)), False
        raise
    return str(made.get("uid") or uid), str(made.get("title") or title), True


def _default_datasource(board: dict[str, Any], source: dict[str, Any]) -> None:
    for var in board.get("templating", {}).get("list", []):
        if var.get("type") == "datasource" and var.get("name") == "datasource":
            var["current"] = {"selected": True, "text": source["name"], "value": source["uid"]}
            return
    raise ProvisionError(f"dashboard {board.get('uid')}: has no `datasource` variable")


@dataclass(frozen=True)
class _Target:
    scheme: str
    host: str
    port: int | None
    prefix: str  # "" or "sub/path/" (grafana-client appends "api")
    display: str  # the URL as messages show it: no trailing slash

    @classmethod
    def parse(cls, url: str) -> _Target:
        url = url.strip()
        example = "expected http(s)://HOST[:PORT][/PATH], e.g. http://127.0.0.1:3000"
        # The URL is never quoted whole in a message: a user:password@ part, a query or a
        # fragment may hold secrets. Checked before anything parses the port.
        before_path = url.split("://", 1)[-1].split("/", 1)[0]
        if "@" in before_path:
            raise ConfigError(
                "Grafana URL: must not carry a user or password (stalwart authenticates with a "
                f"token: {TOKEN_ENV} or --token-file)"
            )
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError as e:
            raise ConfigError(f"Grafana URL: {e}; {example}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            shown = f"{parts.scheme}://" if parts.scheme else "no scheme"
            raise ConfigError(f"Grafana URL ({shown}): {example}")
        if parts.query or parts.fragment:
            raise ConfigError(f"Grafana URL: no query or fragment, {example}")
        path = parts.path.strip("/")
        host = parts.hostname
        netloc_host = f"[{host}]" if ":" in host else host
        display = f"{parts.scheme}://{netloc_host}" + (f":{port}" if port else "")
        display += f"/{path}" if path else ""
        return cls(parts.scheme, netloc_host, port, f"{path}/" if path else "", display)

    def link(self, path: Any) -> str:
        """An absolute link for a path Grafana returned (e.g. /d/UID/slug)."""
        if not isinstance(path, str) or not path:
            return ""
        if path.startswith(("http://", "https://")):
            return path
        origin = f"{self.scheme}://{self.host}" + (f":{self.port}" if self.port else "")
        prefix = "/" + self.prefix.rstrip("/") if self.prefix else ""
        if prefix and not path.startswith(prefix + "/"):
            path = prefix + path  # a Grafana behind a path-stripping proxy
        return origin + path


def _bearer_auth(token: Token) -> Any:
    """grafana-client's auth (niquests calls it per request), without a revealing repr."""
    import niquests.auth

    class BearerAuth(niquests.auth.AuthBase):
        def __call__(self, request: Any) -> Any:
            request.headers["Authorization"] = f"Bearer {token.reveal()}"
            return request

        def __repr__(self) -> str:
            return "BearerAuth(redacted)"

    return BearerAuth()


class _Grafana:
    """grafana-client's GrafanaApi, with each call's failures turned into GrafanaError."""

    def __init__(self, target: _Target, token: Token, timeout: float):
        from grafana_client import GrafanaApi

        self.target = target
        self.timeout = timeout
        self._token = token
        self.api = GrafanaApi(
            auth=_bearer_auth(token),
            protocol=target.scheme,
            host=target.host,
            port=target.port,
            url_path_prefix=target.prefix,
            timeout=timeout,
            user_agent=f"stalwart/{_version()}",
        )

    def frontend_settings(self) -> Any:
        # What grafana-client's health.check() reads (it also works on Amazon Managed
        # Grafana, which has no /api/health); we want its datasources too.
        return self.api.client.GET("/frontend/settings")

    def close(self) -> None:
        self.api.client.s.close()

    def call(
        self,
        what: str,
        expect: type,
        fn: Callable[..., Any],
        *args: Any,
        forbidden: str = "do this",
    ) -> Any:
        from grafana_client.client import (
            GrafanaClientError,
            GrafanaException,
            GrafanaServerError,
            GrafanaTimeoutError,
        )
        from niquests.exceptions import JSONDecodeError, RequestException

        where = self.target.display
        secret = self._token.reveal()
        not_grafana = f"is {where} Grafana's root URL (not a proxy's login page)?"
        try:
            answer = fn(*args)
        except GrafanaTimeoutError:
            raise self._error(
                f"cannot reach Grafana at {where}: no answer to {what} within {self.timeout:g} s"
            ) from None
        except GrafanaClientError as e:
            detail = _detail(e.response, secret)
            if e.status_code == 401:
                msg = (
                    f"Grafana at {where} rejected the token (HTTP 401 on {what}): check "
                    f"{TOKEN_ENV} or --token-file"
                )
            elif e.status_code == 403:
                msg = (
                    f"Grafana at {where} rejected the token (HTTP 403 on {what}): it may not "
                    f"{forbidden}; give its service account the Editor role"
                )
            elif e.status_code == 404 and what.startswith("GET /api/frontend/settings"):
                msg = f"no Grafana API at {where} (HTTP 404 on {what}): {not_grafana}"
            else:
                msg = f"Grafana at {where} refused {what} (HTTP {e.status_code}): {detail}"
                if "provisioned" in detail.lower():
                    msg += (
                        "; that Grafana provisions these dashboards from files: update them "
                        "with `stalwart dashboards export` instead"
                    )
            raise self._error(msg, e.status_code) from None
        except GrafanaServerError as e:
            raise self._error(
                f"Grafana at {where} failed on {what} (HTTP {e.status_code}): "
                f"{_detail(e.response, secret)}",
                e.status_code,
            ) from None
        except GrafanaException as e:
            raise self._error(f"cannot reach Grafana at {where}: {e.message}") from None
        except JSONDecodeError:
            raise self._error(
                f"Grafana at {where} answered {what} with something that is not JSON: {not_grafana}"
            ) from None
        except RequestException as e:
            raise self._error(f"cannot reach Grafana at {where}: {_reason(e)}") from None
        if isinstance(answer, str):
            raise self._error(
                f"Grafana at {where} answered {what} with text, not JSON "
                f"({_detail(answer, secret)!r}): {not_grafana}"
            )
        if not isinstance(answer, expect):
            raise self._error(
                f"Grafana at {where} answered {what} with {_json_kind(answer)}, expected "
                f"{_json_kind(expect())}: {not_grafana}"
            )
        return answer

    def _error(self, message: str, status: int | None = None) -> GrafanaError:
        return GrafanaError(message.replace(self._token.reveal(), "<token>"), status)


def _json_kind(value: Any) -> str:
    kinds = {dict: "a JSON object", list: "a JSON array", type(None): "an empty answer"}
    return kinds.get(type(value), f"a JSON {type(value).__name__}")


def _detail(response: Any, secret: str = "") -> str:
    """A Grafana answer, shortened for a message; `secret` is scrubbed before shortening."""
    if isinstance(response, dict):
        response = response.get("message") or response.get("error") or json.dumps(response)
    text = " ".join(str(response or "no message").split())
    if secret:
        text = text.replace(secret, "<token>")
    return text if len(text) <= _MAX_DETAIL else text[: _MAX_DETAIL - 3] + "..."


def _reason(exc: BaseException) -> str:
    """What went wrong under niquests' wrapping, in a few words."""
    seen: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and e not in seen:
        seen.append(e)
        e = e.__cause__ or e.__context__
    for e in seen:
        if isinstance(e, ConnectionRefusedError):
            return "connection refused (is Grafana running, and listening on that port?)"
        if isinstance(e, socket.gaierror):
            return f"cannot resolve the host name ({e.strerror or e})"
        if isinstance(e, ssl.SSLCertVerificationError):
            return f"TLS certificate not trusted ({e.verify_message or e})"
        if isinstance(e, ssl.SSLError):
            return f"TLS failed ({e.reason or e})"
        if isinstance(e, TimeoutError):
            return "connection timed out"
    innermost = seen[-1]
    return _detail(str(innermost) or type(innermost).__name__)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("stalwart")
    except PackageNotFoundError:
        return "dev"

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
message about a Grafana answer is scrubbed of it (dashboards/grafana_api.py: the token, the
URL and the API client with its errors).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from stalwart.dashboards.__main__ import render
from stalwart.dashboards.grafana_api import (
    ConfigError,
    GrafanaError,
    ProvisionError,
    Token,
    _Grafana,
    _Target,
    read_token,  # noqa: F401 (the CLI's, with the errors and the token, from here)
)

FOLDER = "stalwart"
PROVISIONING_FILE = "stalwart-dashboards.yaml"
DEFAULT_TIMEOUT_S = 10.0
UPDATE_INTERVAL_S = 30  # how often Grafana's file provider rescans the directory


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

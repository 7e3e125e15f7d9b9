"""Grafana's HTTP API as `stalwart dashboards push` (dashboards/provision.py) uses it: the
errors a provisioning step raises, the token (from GRAFANA_TOKEN or a file, never shown:
`Token` hides it, and every message about a Grafana answer is scrubbed of it), the URL
checked and shown without secrets, and grafana-client's GrafanaApi behind `_Grafana`, each
call's failures turned into a one-line GrafanaError. grafana-client is imported only when a
push starts."""

from __future__ import annotations

import json
import os
import socket
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

TOKEN_ENV = "GRAFANA_TOKEN"
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

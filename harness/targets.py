"""Targets: the server a run drives. An OpenAI-compatible URL, or the reference engine started
on loopback and stopped on every exit path; the preflight that proves it answers."""

from __future__ import annotations

import contextlib
import json
import urllib.error
import urllib.request
from dataclasses import dataclass

from harness.config import RunConfig
from harness.errors import HarnessError
from harness.managed import ManagedServer, ManagedServerConfig, managed_server

DEFAULT_MODEL = "smollm2-135m"


def _get(url: str, api_key: str | None, timeout_s: float, extra_headers=()):
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    headers.update(extra_headers)
    return urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout_s)


def preflight(
    base_url: str, timeout_s: float = 10.0, api_key: str | None = None, headers=()
) -> dict:
    """GET `<base_url>/models`: proves the target is reachable; returns its JSON (or {}).

    `headers`: (name, value) pairs sent besides the API key (`--header`). A 401 or 403 ends the run before it starts, in one sentence naming `--api-key`."""
    url = base_url.rstrip("/") + "/models"
    try:
        with _get(url, api_key, timeout_s, headers) as resp:
            return json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        exc.close()  # it holds the answer's socket
        if exc.code in (401, 403):
            given = "refused the API key given" if api_key else "needs an API key"
            raise HarnessError(
                f"the target at {base_url} {given} (HTTP {exc.code} for GET /models); "
                "pass it with --api-key or OPENAI_API_KEY."
            ) from exc
        return {}  # reachable; some servers have no /models
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise HarnessError(
            f"cannot reach the target at {base_url} ({reason}); check --url and that the server is running."
        ) from exc
    except json.JSONDecodeError:
        return {}


def target_info(base_url: str, api_key: str | None = None, headers=()) -> dict:
    """The reference engine's `/info` (engine, version, model, dtype, config), when present."""
    root = base_url.rstrip("/").removesuffix("/v1")
    try:
        with _get(root + "/info", api_key, 5, headers) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        exc.close()
        return {}
    except (urllib.error.URLError, OSError, json.JSONDecodeError):
        return {}


@dataclass(frozen=True)
class Target:
    """What a run drives: its base URL, its manifest entry, and the server process when the
    harness manages it (engine faults act on it)."""

    base_url: str
    entry: dict
    server: ManagedServer | None = None


@contextlib.contextmanager
def target_for(config: RunConfig, *, extra_args: tuple[str, ...] = ()):
    """Yield the `Target`: `config.url`, or a managed reference server, whose command line gets
    `--server-arg`s and then `extra_args` (a fault plan's)."""
    if config.url is not None:
        yield Target(config.url, {"kind": "url", "url": config.url})
        return
    server_cfg = ManagedServerConfig(
        model=config.model or DEFAULT_MODEL,
        extra_args=(*config.server_args, *extra_args),
        startup_timeout_s=config.startup_timeout_s,
    )
    with managed_server(server_cfg) as server:
        entry = {"kind": "managed", "url": server.base_url, "server_log": str(server.log_path)}
        yield Target(server.base_url, entry, server)

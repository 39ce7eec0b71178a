"""What a target says about itself over HTTP: the preflight that proves it answers
(`GET /models`) and the reference engine's `/info`."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from harness.errors import HarnessError
from harness.http.client import auth_headers


def _get(url: str, api_key: str | None, timeout_s: float, extra_headers=()):
    request = urllib.request.Request(url, headers=auth_headers(api_key, extra_headers))
    return urllib.request.urlopen(request, timeout=timeout_s)


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

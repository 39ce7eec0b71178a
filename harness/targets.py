"""Targets: the server a run drives. An OpenAI-compatible URL, or the reference engine started
on loopback and stopped on every exit path; the preflight that proves it answers."""

from __future__ import annotations

import contextlib
import json
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from harness.config import RunConfig, normalise_base_url
from harness.engines import ENGINES, LaunchPlan, parse_assignments, parse_target, plan_launch
from harness.errors import HarnessError
from harness.http.client import auth_headers
from harness.launch import CommandServer, engine_version, free_port, launched
from harness.managed import ManagedServer, ManagedServerConfig, managed_server

DEFAULT_MODEL = "smollm2-135m"


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


@dataclass(frozen=True)
class Target:
    """What a run drives: its base URL, its manifest entry, the server process when the
    harness manages it (engine faults act on it), and a managed external engine's launch plan
    (its weights say which tokenizer counts for it)."""

    base_url: str
    entry: dict
    server: ManagedServer | CommandServer | None = None
    plan: LaunchPlan | None = None


def launch_plan_for(config: RunConfig) -> LaunchPlan | None:
    """The resolved launch of a managed external engine (`--target vllm|llamacpp`), its
    weights prepared; None for the reference engine and for URL targets."""
    if config.url is not None:
        return None
    kind, _ = parse_target(config.target)
    if kind not in ENGINES:
        return None
    model = config.model or DEFAULT_MODEL
    return plan_launch(
        kind,
        model,
        served_model=model,
        command=parse_assignments(config.engine_commands, "--engine-command").get(kind),
        python=parse_assignments(config.engine_pythons, "--engine-python").get(kind),
        port=free_port(),
    )


@contextlib.contextmanager
def target_for(
    config: RunConfig,
    *,
    log_dir: Path | None = None,
    plan: LaunchPlan | None = None,
    extra_args: tuple[str, ...] = (),
):
    """Yield the `Target`: `config.url` or `--target url:...`, a managed external engine
    (`plan`, else resolved here), or a managed reference server, whose command line gets
    `--server-arg`s and then `extra_args` (a fault plan's `engine_args`). A managed server's
    log goes to `log_dir/server.log` when given (the run directory)."""
    kind, url = ("url", config.url) if config.url is not None else parse_target(config.target)
    if kind == "url":
        url = normalise_base_url(url)
        yield Target(url, {"kind": "url", "url": url})
        return
    if kind in ENGINES:
        if extra_args:
            raise HarnessError(
                f"the fault plan starts the engine with {' '.join(extra_args)}, which only the "
                f"reference engine understands; drop engine_args and slow_steps windows to run "
                f"it against {kind}."
            )
        plan = plan or launch_plan_for(config)
        log_dir = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="bench-"))
        version = engine_version(plan)
        with launched(plan, plan.port, log_dir / "server.log", config.startup_timeout_s) as server:
            entry = {
                "kind": "managed",
                "url": server.base_url,
                "engine": plan.spec.name,
                "engine_version": version,
                "engine_command": list(plan.argv),
                "engine_env": plan.env,
                "weights": plan.weights_path,
                "serialises_requests": plan.spec.serialises_requests,
                "server_log": str(server.log_path),
            }
            yield Target(server.base_url, entry, server, plan)
        return
    server_cfg = ManagedServerConfig(
        model=config.model or DEFAULT_MODEL,
        # usage.prompt_tokens_details.cached_tokens on every answer: the prefix-cache hits
        # the run records per request (multi-turn sessions report their hit rate from it)
        extra_args=("--enable-prompt-tokens-details", *config.server_args, *extra_args),
        startup_timeout_s=config.startup_timeout_s,
    )
    with managed_server(server_cfg, log_dir=log_dir) as server:
        entry = {"kind": "managed", "url": server.base_url, "server_log": str(server.log_path)}
        yield Target(server.base_url, entry, server)

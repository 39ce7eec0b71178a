"""The target a run drives, reached or started: an OpenAI-compatible URL, a managed external
engine, or the reference engine started on loopback and stopped on every exit path."""

from __future__ import annotations

import contextlib
import tempfile
from dataclasses import dataclass
from pathlib import Path

from harness.errors import HarnessError
from harness.targets.config import TargetConfig
from harness.targets.engines import DEFAULT_MODEL, LaunchPlan, parse_assignments, plan_launch
from harness.targets.launch import engine_version, free_port, launched
from harness.targets.managed import ManagedServerConfig, managed_server
from harness.targets.process import ServerProcess


@dataclass(frozen=True)
class Target:
    """What a run drives: its base URL, its manifest entry, the server process when the
    harness manages it (engine faults act on it), and a managed external engine's launch plan
    (its weights say which tokenizer counts for it)."""

    base_url: str
    entry: dict
    server: ServerProcess | None = None
    plan: LaunchPlan | None = None


def launch_plan_for(target: TargetConfig) -> LaunchPlan | None:
    """The resolved launch of a managed external engine (`--target vllm|llamacpp`), its
    weights prepared; None for the reference engine and for URL targets."""
    kind = target.spec.kind
    if target.spec.engine is None:
        return None
    model = target.model or DEFAULT_MODEL
    return plan_launch(
        kind,
        model,
        served_model=model,
        command=parse_assignments(target.engine_commands, "--engine-command").get(kind),
        python=parse_assignments(target.engine_pythons, "--engine-python").get(kind),
        port=free_port(),
    )


@contextlib.contextmanager
def target_for(
    target: TargetConfig,
    *,
    log_dir: Path | None = None,
    plan: LaunchPlan | None = None,
    extra_args: tuple[str, ...] = (),
):
    """Yield the `Target`: a running server (`--url`, `--target url:...`), a managed external
    engine (`plan`, else resolved here), or a managed reference server, whose command line
    gets `--server-arg`s and then `extra_args` (a fault plan's `engine_args`, which only the
    reference engine understands). A managed server's log goes to `log_dir/server.log` when
    given (the run directory)."""
    spec = target.spec
    if spec.is_url:
        yield Target(spec.url, {"kind": "url", "url": spec.url})
        return
    if spec.engine is not None:
        if extra_args:
            raise HarnessError(
                f"the fault plan starts the engine with {' '.join(extra_args)}, which only the "
                f"reference engine understands; drop engine_args and slow_steps windows to run "
                f"it against {spec.kind}."
            )
        plan = plan or launch_plan_for(target)
        log_dir = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="bench-"))
        version = engine_version(plan)
        log_path = log_dir / "server.log"
        with launched(plan, plan.port, log_path, target.startup_timeout_s) as server:
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
        model=target.model or DEFAULT_MODEL,
        # usage.prompt_tokens_details.cached_tokens on every answer: the prefix-cache hits
        # the run records per request (multi-turn sessions report their hit rate from it)
        extra_args=("--enable-prompt-tokens-details", *target.server_args, *extra_args),
        startup_timeout_s=target.startup_timeout_s,
    )
    with managed_server(server_cfg, log_dir=log_dir) as server:
        entry = {"kind": "managed", "url": server.base_url, "server_log": str(server.log_path)}
        yield Target(server.base_url, entry, server)

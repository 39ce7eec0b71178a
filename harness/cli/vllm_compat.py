"""`vllm bench serve`'s flags on `bench run`, with vLLM's meaning.

A vLLM command line pasted after `bench run` runs unchanged: the aliases below are translated
into `RunConfig` fields (and a `ResultFileRequest` for `--save-result`) before anything runs.
Where vLLM's meaning differs from a harness default, vLLM's wins when a vLLM flag is used:
the request rate defaults to inf (every request at once) instead of the workload's own, and
`--max-concurrency` caps in-flight requests over those arrivals rather than running a closed
loop; and the target is `--base-url`, or `--host`/`--port`, with vLLM's defaults
(127.0.0.1:8000) for what is not given, rather than a reference engine started for the run. vLLM flags the harness cannot
honour (another dataset, an audio backend) end in one sentence naming what it can do.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import click

from harness.errors import HarnessError

# vLLM's text backends; openai-chat drives the chat API, the others the completions API.
VLLM_BACKENDS = ("openai", "openai-chat", "vllm")
CHAT_BACKEND = "openai-chat"
VLLM_DATASETS = ("random", "sharegpt")  # vLLM dataset names that are built-in workloads here
VLLM_DEFAULT_HOST = "127.0.0.1"
VLLM_DEFAULT_PORT = 8000
# the last two only with --max-concurrency, as in vLLM (reports.exports.vllm.VLLM_METRICS)
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el", "client_queue_time",
                      "e2el_including_client_queue")  # fmt: skip
VLLM_GOODPUT_KEYS = {"ttft": "ttft_ms", "tpot": "tpot_ms", "e2el": "e2e_ms"}  # -> SLO field
# AIPerf's `--goodput` metric tags with the same meanings (ms): its inter_token_latency is
# per request (request_latency - time_to_first_token) / (output tokens - 1), vLLM's TPOT
AIPERF_GOODPUT_KEYS = {"time_to_first_token": "ttft_ms", "inter_token_latency": "tpot_ms",
                       "request_latency": "e2e_ms"}  # fmt: skip
GOODPUT_KEYS = {**VLLM_GOODPUT_KEYS, **AIPERF_GOODPUT_KEYS}
NARGS_PLUS = ("--goodput", "--metadata")  # vLLM takes several space-separated values here
# A sampling flag of vLLM's and the request field it sets.
SAMPLING_FLAGS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                  "min_p": "min_p"}  # fmt: skip

_ALIASES = (
    click.option("--backend", type=click.Choice(VLLM_BACKENDS),
                 help="vLLM: openai/vllm drive /v1/completions, openai-chat /v1/chat/completions."),
    click.option("--base-url", help="vLLM: server root, e.g. http://127.0.0.1:8000 (/v1 is added)."),
    click.option("--host", help=f"vLLM: server host (default {VLLM_DEFAULT_HOST} with --port)."),
    click.option("--port", type=int, help=f"vLLM: server port (default {VLLM_DEFAULT_PORT} with --host)."),
    click.option("--num-prompts", type=int, help="vLLM: same as --num-requests."),
    click.option("--max-concurrency", type=int,
                 help="vLLM: cap on in-flight requests; arrivals at --request-rate (default inf)."),
    click.option("--dataset-name", help=f"vLLM: {' or '.join(VLLM_DATASETS)} (same as --workload)."),
    click.option("--random-input-len", type=int, help="vLLM: same as --input-len."),
    click.option("--random-output-len", type=int, help="vLLM: same as --output-len."),
    click.option("--random-range-ratio", type=float, help="vLLM: same as --range-ratio."),
    click.option("--num-warmups", type=int, help="vLLM: same as --warmup."),
    click.option("--goodput", help="vLLM: per-request goodput limits in ms, e.g. 'ttft:500 tpot:50 e2el:5000' "
                 "(AIPerf's names too: 'time_to_first_token:500 inter_token_latency:50 request_latency:5000')."),
    click.option("--percentile-metrics",
                 help="vLLM: metrics in the --save-result file (default ttft,tpot,itl; also e2el)."),
    click.option("--metric-percentiles", help="vLLM: percentiles in the --save-result file (default 99)."),
    click.option("--save-result", is_flag=True, help="vLLM: also write vLLM's result JSON."),
    click.option("--save-detailed", is_flag=True, help="vLLM: put per-request arrays in that JSON."),
    click.option("--result-dir", type=click.Path(path_type=Path), help="vLLM: directory for that JSON."),
    click.option("--result-filename", help="vLLM: file name for that JSON."),
    click.option("--label", help="vLLM: label in that JSON and its file name (default: --backend)."),
    click.option("--metadata", help="vLLM: KEY=VALUE pairs added to that JSON."),
    click.option("--temperature", type=float, help="vLLM: sampling temperature on every request."),
    click.option("--top-p", type=float, help="vLLM: top_p on every request."),
    click.option("--top-k", type=int, help="vLLM: top_k on every request."),
    click.option("--min-p", type=float, help="vLLM: min_p on every request."),
    click.option("--disable-tqdm", is_flag=True, help="vLLM: no progress bar."),
    click.option("--trust-remote-code", is_flag=True, hidden=True),  # no remote code runs here
    click.option("--skip-chat-template", is_flag=True, hidden=True),  # none is applied here
    click.option("--header", "headers", multiple=True,
                 help="Extra HTTP header on every request, NAME:VALUE (repeatable); not recorded."),
    click.option("--slice-duration", "slice_duration_s", type=float,
                 help="Also slice the card by time windows of this many seconds (as AIPerf's "
                 "--slice-duration; the drain after the last send is left out)."),
    click.option("--extra-body", help="JSON object merged into every request body, e.g. '{\"top_k\": 20}'."),
)  # fmt: skip

_VLLM_KEYS = ("backend", "base_url", "host", "port", "num_prompts", "max_concurrency",
              "dataset_name", "random_input_len", "random_output_len", "random_range_ratio",
              "num_warmups", "goodput", "percentile_metrics", "metric_percentiles", "save_result",
              "save_detailed", "result_dir", "result_filename", "label", "metadata",
              "temperature", "top_p", "top_k", "min_p", "disable_tqdm", "trust_remote_code",
              "skip_chat_template", "headers", "extra_body", "slice_duration_s")  # fmt: skip


_GENERAL_KEYS = (
    "headers",
    "extra_body",
    "slice_duration_s",
)  # options of ours listed here, not vLLM's


def vllm_options(command):
    """Add vLLM's `bench serve` flags (translated by `translate`) to a command."""
    for option in reversed(_ALIASES):
        command = option(command)
    return command


def fold_nargs_plus(args: list[str]) -> list[str]:
    """Join the values vLLM takes as `nargs="+"` (`--goodput ttft:1 tpot:2`) into one argument."""
    out: list[str] = []
    i = 0
    while i < len(args):
        out.append(args[i])
        if args[i] in NARGS_PLUS:
            values = []
            while i + 1 < len(args) and not args[i + 1].startswith("-"):
                i += 1
                values.append(args[i])
            if values:
                out.append(" ".join(values))
        i += 1
    return out


class VllmCompatCommand(click.Command):
    """A click command that also parses vLLM's several-values-per-flag arguments."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        return super().parse_args(ctx, fold_nargs_plus(list(args)))


@dataclass(frozen=True)
class ResultFileRequest:
    """What `--save-result` and its companions asked for (vLLM's result JSON)."""

    backend: str = "vllm"
    label: str | None = None
    result_dir: Path | None = None
    result_filename: str | None = None
    detailed: bool = False
    percentile_metrics: tuple[str, ...] = ("ttft", "tpot", "itl")
    metric_percentiles: tuple[float, ...] = (99.0,)
    metadata: dict = field(default_factory=dict)


def _same(kwargs: dict, ours: str, value, flag: str, our_flag: str) -> None:
    """Set `kwargs[ours]` from a vLLM alias; refuse two different values for one setting."""
    if value is None:
        return
    if kwargs.get(ours) is not None and kwargs[ours] != value:
        raise HarnessError(f"{flag} and {our_flag} say different things; give one of them.")
    kwargs[ours] = value


def parse_goodput(text: str) -> dict:
    """vLLM's `--goodput 'ttft:500 tpot:50 e2el:5000'` (ms) as an SLO spec dict (per request).

    AIPerf's names for the same limits (`time_to_first_token`, `inter_token_latency`,
    `request_latency`, ms) are accepted beside vLLM's and may be mixed with them; one limit
    given twice under its two names must agree."""
    limits, given = {}, {}
    for item in text.replace(",", " ").split():
        key, sep, value = item.partition(":")
        if not sep or key not in GOODPUT_KEYS:
            raise HarnessError(
                f"--goodput takes KEY:MS pairs with KEY one of vLLM's "
                f"{', '.join(VLLM_GOODPUT_KEYS)} or AIPerf's {', '.join(AIPERF_GOODPUT_KEYS)}; "
                f"got {item!r}."
            )
        try:
            ms = float(value)
        except ValueError:
            raise HarnessError(f"--goodput {key} must be a number of ms, got {value!r}.") from None
        if not ms > 0 or math.isinf(ms):
            raise HarnessError(f"--goodput {key} must be a positive number of ms, got {value!r}.")
        field_name = GOODPUT_KEYS[key]
        if limits.get(field_name, ms) != ms:
            raise HarnessError(
                f"--goodput gives one limit twice, {given[field_name]!r} and {item!r}; "
                "give it once."
            )
        limits[field_name], given[field_name] = ms, item
    if not limits:
        raise HarnessError("--goodput needs at least one KEY:MS pair, e.g. 'ttft:500'.")
    return {"name": "goodput", "source": f"--goodput {text}",
            "description": "per-request limits from --goodput (vLLM's request goodput)",
            "per_request": limits}  # fmt: skip


def _percentile_metrics(text: str | None) -> tuple[str, ...]:
    if text is None:
        return ResultFileRequest.percentile_metrics
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    bad = [n for n in names if n not in PERCENTILE_METRICS]
    if bad or not names:
        raise HarnessError(
            f"--percentile-metrics takes a comma list of {', '.join(PERCENTILE_METRICS)}; got {text!r}."
        )
    return names


def _metric_percentiles(text: str | None) -> tuple[float, ...]:
    if text is None:
        return ResultFileRequest.metric_percentiles
    try:
        values = tuple(float(p) for p in text.split(",") if p.strip())
    except ValueError:
        values = ()
    if not values or not all(0 < p < 100 for p in values):
        raise HarnessError(
            f"--metric-percentiles takes a comma list of numbers between 0 and 100; got {text!r}."
        )
    return values


def _metadata(text: str | None) -> dict:
    out = {}
    for item in (text or "").split():
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise HarnessError(f"--metadata takes KEY=VALUE pairs; got {item!r}.")
        out[key] = value
    return out


def parse_headers(values: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """`--header 'Name: value'` (or `Name=value`, vLLM's form) as (name, value) pairs."""
    out = []
    for text in values:
        cut = min((i for i in (text.find(":"), text.find("=")) if i > 0), default=-1)
        name, value = (text[:cut].strip(), text[cut + 1 :].strip()) if cut > 0 else ("", "")
        if not name or any(c in name for c in " \t\r\n") or any(c in value for c in "\r\n"):
            raise HarnessError(f"--header takes NAME:VALUE (e.g. 'X-Team: search'); got {text!r}.")
        out.append((name, value))
    return tuple(out)


def parse_extra_body(text: str | None) -> dict | None:
    """`--extra-body '{"top_k": 20}'`: a JSON object merged into every request body."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise HarnessError(
            f"--extra-body is not valid JSON ({exc.msg} at char {exc.pos})."
        ) from None
    if not isinstance(value, dict):
        raise HarnessError(f"--extra-body must be a JSON object, got {type(value).__name__}.")
    return value


def _target_url(kwargs: dict, base_url, host, port) -> None:
    if base_url is None and host is None and port is None:
        return
    if kwargs.get("url") is not None:
        raise HarnessError("--url names the target already; drop --base-url, --host and --port.")
    if base_url is not None and (host is not None or port is not None):
        raise HarnessError("--base-url names the target already; drop --host and --port.")
    if base_url is None:
        base_url = f"http://{host or VLLM_DEFAULT_HOST}:{port or VLLM_DEFAULT_PORT}"
    kwargs["url"] = base_url


def translate(kwargs: dict) -> tuple[dict, ResultFileRequest | None, bool]:
    """Fold the vLLM aliases in `kwargs` (click's values for `bench run`) into RunConfig fields.

    Returns (kwargs without the vLLM keys, the `--save-result` request or None, whether
    `--disable-tqdm` asked for no progress). Raises `HarnessError` for contradictions.
    """
    kwargs = dict(kwargs)
    v = {key: kwargs.pop(key, None) for key in _VLLM_KEYS}
    if v["headers"]:
        kwargs["headers"] = parse_headers(v["headers"])
    if v["slice_duration_s"] is not None:
        kwargs["slice_duration_s"] = v["slice_duration_s"]
    extra_body = parse_extra_body(v["extra_body"])
    if extra_body is not None:
        kwargs["extra_body"] = extra_body
    _target_url(kwargs, v["base_url"], v["host"], v["port"])
    if kwargs.get("target") is not None and kwargs.get("url") is not None:
        raise HarnessError(
            f"--target {kwargs['target']} names the target already; drop --url "
            "(and --base-url, --host, --port), or drop --target."
        )
    if v["backend"] is not None:
        from slo.runrecord import Endpoint  # here: `bench --help` stays light

        endpoint = Endpoint.CHAT if v["backend"] == CHAT_BACKEND else Endpoint.COMPLETIONS
        if kwargs.get("endpoint") is not None and kwargs["endpoint"] != endpoint:
            raise HarnessError(
                f"--backend {v['backend']} drives {endpoint.path}, but --endpoint says "
                f"{Endpoint(kwargs['endpoint']).path}; give one that agrees."
            )
        kwargs["endpoint"] = endpoint
    if v["dataset_name"] is not None and v["dataset_name"] not in VLLM_DATASETS:
        raise HarnessError(
            f"--dataset-name {v['dataset_name']} is not available here; use "
            f"{' or '.join(VLLM_DATASETS)}, or --workload (bench workload list)."
        )
    _same(kwargs, "workload", v["dataset_name"], "--dataset-name", "--workload")
    _same(kwargs, "num_requests", v["num_prompts"], "--num-prompts", "--num-requests")
    _same(kwargs, "input_len", v["random_input_len"], "--random-input-len", "--input-len")
    _same(kwargs, "output_len", v["random_output_len"], "--random-output-len", "--output-len")
    _same(kwargs, "range_ratio", v["random_range_ratio"], "--random-range-ratio", "--range-ratio")
    _same(kwargs, "warmup", v["num_warmups"], "--num-warmups", "--warmup")
    _same(kwargs, "concurrency", v["max_concurrency"], "--max-concurrency", "--concurrency")
    vllm_used = any(
        v[key] not in (None, False, ()) for key in _VLLM_KEYS if key not in _GENERAL_KEYS
    )
    if vllm_used and kwargs.get("url") is None and kwargs.get("target") is None:
        # vLLM's default target, as `vllm bench serve` would drive it (never over a --target)
        kwargs["url"] = f"http://{VLLM_DEFAULT_HOST}:{VLLM_DEFAULT_PORT}"
    if vllm_used and kwargs.get("request_rate") is None and kwargs.get("duration_s") is None:
        # vLLM's default: every request at once (a --max-concurrency cap still applies)
        kwargs["request_rate"] = math.inf
    if v["goodput"] is not None:
        if kwargs.get("slo") is not None:
            raise HarnessError("--goodput and --slo both define goodput; give one of them.")
        kwargs["slo"] = parse_goodput(v["goodput"])
    sampling = {body: v[flag] for flag, body in SAMPLING_FLAGS.items() if v[flag] is not None}
    if sampling:
        kwargs["extra_body"] = {**sampling, **(kwargs.get("extra_body") or {})}
    request = None
    if v["save_result"]:  # as in vLLM, --result-dir and the rest only shape a saved result
        request = ResultFileRequest(
            backend=v["backend"] or "vllm",
            label=v["label"],
            result_dir=v["result_dir"],
            result_filename=v["result_filename"],
            detailed=bool(v["save_detailed"]),
            percentile_metrics=_percentile_metrics(v["percentile_metrics"]),
            metric_percentiles=_metric_percentiles(v["metric_percentiles"]),
            metadata=_metadata(v["metadata"]),
        )
    else:
        _percentile_metrics(v["percentile_metrics"])  # still refuse a bad value
        _metric_percentiles(v["metric_percentiles"])
    return kwargs, request, bool(v["disable_tqdm"])


def save_result(request: ResultFileRequest, run_dir: Path) -> Path:
    """Write vLLM's result JSON for `run_dir` where `--result-dir`/`--result-filename` say
    (default: vLLM's file name in the current directory); returns its path."""
    from reports.exports.vllm import vllm_result, vllm_result_filename

    result = vllm_result(
        run_dir,
        backend=request.backend,
        label=request.label,
        percentile_metrics=request.percentile_metrics,
        metric_percentiles=request.metric_percentiles,
        detailed=request.detailed,
        metadata=request.metadata,
    )
    path = Path(request.result_filename or vllm_result_filename(result))
    if request.result_dir is not None:
        path = Path(request.result_dir) / path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    except OSError as exc:
        raise HarnessError(f"cannot write the vLLM result {path}: {exc.strerror or exc}.") from exc
    return path

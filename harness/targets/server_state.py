"""The target's idle gauges (`/metrics`), read before a run and after it drained, for the
ledger's leak check (`slo.ledger.leak_check`)."""

from __future__ import annotations

import time
import urllib.error
import urllib.request

from harness.http.client import auth_headers
from harness.targets.scraper import parse_metrics

# Prometheus sample name -> ledger gauge. vLLM and the reference engine share the `vllm:` names;
# `kv_cache_blocks_used` (the reference engine) counts blocks held by requests, which a warm
# prefix cache does not inflate; vLLM has only the usage fraction.
GAUGES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_blocks_used": "kv_blocks_used",
    "vllm:kv_cache_usage_perc": "kv_usage_perc",
    "vllm:gpu_cache_usage_perc": "kv_usage_perc",  # vLLM before v1
}


def read_gauges(metrics_url: str, *, api_key: str | None = None, timeout_s: float = 5.0) -> dict:
    """`{gauge: value}` summed over label sets; `{}` when the target has no such `/metrics`."""
    request = urllib.request.Request(metrics_url, headers=auth_headers(api_key))
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            text = resp.read().decode("utf-8", "replace")
        samples = parse_metrics(text)
    except urllib.error.HTTPError as exc:  # no /metrics here; close the answer it carries
        exc.close()
        return {}
    except (urllib.error.URLError, OSError, ValueError):
        return {}
    values: dict[str, float] = {}
    for name, _labels, value in samples:
        gauge = GAUGES.get(name)
        if gauge is not None:
            values[gauge] = values.get(gauge, 0.0) + value
    return values


def is_idle(after: dict, before: dict) -> bool:
    if after.get("running", 0) > 0 or after.get("waiting", 0) > 0:
        return False
    for name in ("kv_blocks_used", "kv_usage_perc"):
        if name in after and name in before:
            return after[name] <= before[name]
    return True


def settle(metrics_url: str, before: dict, *, api_key: str | None, settle_s: float) -> dict:
    """Poll until the target is back at `before` (or `settle_s` passed); returns the
    `server_state` manifest entry `{before, after, settle_s_used}`."""
    if not before:
        return {"before": before, "after": {}, "settle_s_used": 0.0}
    start = time.monotonic()
    after = read_gauges(metrics_url, api_key=api_key)
    while after and not is_idle(after, before) and time.monotonic() - start < settle_s:
        time.sleep(0.2)
        after = read_gauges(metrics_url, api_key=api_key)
    return {"before": before, "after": after, "settle_s_used": round(time.monotonic() - start, 3)}

"""The router's P/D mode (`bench serve --prefill-workers P --decode-workers D`): each
generation request is prefilled on one worker and decoded on another (`pd_worker`).

Per /v1/completions or /v1/chat/completions request the router picks the least-loaded prefill
worker and the least-loaded decode worker (in flight at the router), sends the body to the
prefill worker with `kv_transfer_params: {do_remote_decode, transfer_id, decode_kv}` and
relays its first-token chunk(s) to the client at once; once the prefill worker's final usage
says the KV transfer succeeded, it sends the body to the decode worker with
`{do_remote_prefill, transfer_id}` and relays the rest. The client sees one response in the
API's own shape: the prefill worker's id and created time, one role delta (chat), finish
reasons as the single server gives them, text offsets counted from the start of the whole
text, and one usage: prompt_tokens from the prefill worker, completion_tokens counting every
token, plus the `kv_transfer` extension (docs/CONTRACTS.md; the router adds the decode worker's
name and install time). With `continuous_usage_stats` (`bench run`'s default) each relayed
chunk's usage is rewritten the same way: the prefill's prompt, every output token so far. The
`x-bench-worker` header names the decode worker, chosen before the prefill leg so that a
stream's headers carry it; a non-streamed answer that ended at its first token names the
prefill worker. A request that ends at its first token (max_tokens 1, a stop) never reaches a
decode worker. Requests P/D cannot carry (n > 1, best_of, beam search, tools, guided output),
the other generation APIs (/v1/responses, /v1/messages) and the dense routes go to the
least-loaded decode worker as plain requests.

Failures are explicit. A transfer that failed (a block that failed its checksum, a cut or
refused connection, a decode worker gone) is retried once by recompute: a decode worker (another
one when there is one) gets `{recompute_token_ids: [first token ids]}`, prefills the prompt
with them and continues, and `kv_transfer.retried` says "recompute". When that fails too, the
client gets a 502 (or an error event in the stream) with the reason. A decode worker without
free blocks for the handoff (after waiting up to its `install_wait_s`) refuses it: the client
gets 503 with Retry-After (or an error event). A client may not set `kv_transfer_params`; with
`--enable-fault-injection` its `{"fault": "flip_bit"}` passes to the prefill worker.

/metrics adds `router_kv_transfers_total{worker,result}` (result ok, failed, recomputed,
no_free_blocks) and `router_kv_transfer_bytes_total{worker}` per decode worker; /info's
`cluster` block says the layout (`pd`).
"""

from __future__ import annotations

import asyncio
import functools
import json
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily

from engine_ref.cluster.pd_procs import PDProcess, start_pd_workers, stop_pd_workers
from engine_ref.cluster.router import (
    WORKER_HEADER,
    Cluster,
    NotDelivered,
    create_router_app,
    forwarded_headers,
    relay,
    routed_error,
    worker_name,
)
from engine_ref.cluster.routing import make_policy
from engine_ref.serving.errors import ApiError, error_body
from engine_ref.serving.requests import decode_json_body
from engine_ref.serving.server import ServerConfig, serve_app

__all__ = ["PD_PATHS", "PDRouting", "serve_pd_cluster"]

PD_PATHS = ("/v1/completions", "/v1/chat/completions")
# Body fields whose requests a KV handoff cannot carry (kv_handoff: one sequence, no grammar).
# (`echo` would repeat the prompt in both halves.)
_NOT_PD = ("tools", "response_format", "guided_json", "guided_regex", "guided_choice",
           "guided_grammar", "structured_outputs", "use_beam_search", "echo")  # fmt: skip
_INTERNAL = ("first_token_ids", "error_kind")  # kv_transfer fields the router alone reads


class _Failed(Exception):
    """A P/D leg failed: `status` and one sentence for the client."""

    def __init__(self, status: int, message: str, *, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.retry_after = status, message, retry_after


class PDRouting:
    """The P/D state of a cluster whose workers are `PDProcess`es: who prefills, who
    decodes, and the KV transfer counters per decode worker."""

    def __init__(self, workers: list[PDProcess], *, fault_injection: bool = False) -> None:
        self.prefill = [w for w in workers if w.role == "prefill"]
        self.decode = [w for w in workers if w.role == "decode"]
        self.fault_injection = fault_injection
        self.transfers: Counter[tuple[int, str]] = Counter()
        self.transfer_bytes: Counter[int] = Counter()

    def describe(self) -> dict[str, Any]:
        return {
            "prefill_workers": [w.url for w in self.prefill],
            "decode_workers": [{"url": w.url, "kv_port": w.kv_port} for w in self.decode],
        }

    def families(self) -> str:
        transfers = CounterMetricFamily(
            "router_kv_transfers", "KV handoffs per decode worker, by result.",
            labels=["worker", "result"],
        )  # fmt: skip
        for (index, result), count in sorted(self.transfers.items()):
            transfers.add_metric([str(index), result], count)
        nbytes = CounterMetricFamily(
            "router_kv_transfer_bytes", "KV handoff bytes sent to each decode worker.",
            labels=["worker"],
        )  # fmt: skip
        for w in self.decode:
            nbytes.add_metric([str(w.index)], self.transfer_bytes[w.index])
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Families([transfers, nbytes]))
        return generate_latest(registry).decode()

    def least_loaded(self, cluster: Cluster, pool: list[PDProcess], avoid: int | None = None):
        live = [w for w in pool if w.index not in cluster.down and w.alive]
        preferred = [w for w in live if w.index != avoid] or live

        def load(worker: PDProcess) -> tuple[int, int]:
            # Ties go to the worker routed fewest requests, so an idle cluster still spreads.
            return cluster.inflight[worker.index], cluster.routed[worker.index]

        return min(preferred, key=load, default=None)

    async def route(
        self, request: web.Request, cluster: Cluster, path: str, raw: bytes
    ) -> web.StreamResponse:
        try:  # in a worker thread, as the server parses: a large body never holds up the loop
            loop = asyncio.get_running_loop()
            body = await loop.run_in_executor(cluster.parser, decode_json_body, raw)
        except ApiError:
            body = None  # the decode worker answers the 400
        client_params = body.pop("kv_transfer_params", None) if body is not None else None
        if body is not None and client_params is not None:
            raw = json.dumps(body).encode()
        decode = self.least_loaded(cluster, self.decode)
        if decode is None:
            return routed_error(503, "No decode worker of this cluster is running.", path)
        if body is None or path not in PD_PATHS or not _pd_capable(body):
            return await self._plain(request, cluster, decode, raw)
        prefill = self.least_loaded(cluster, self.prefill)
        if prefill is None:
            return routed_error(503, "No prefill worker of this cluster is running.", path)
        fault = None
        if self.fault_injection and isinstance(client_params, dict):
            fault = client_params.get("fault")
        leg = _Legs(self, cluster, request, path, body, prefill, decode, fault)
        return await leg.run()

    async def _plain(self, request, cluster: Cluster, worker: PDProcess, raw: bytes):
        cluster.routed[worker.index] += 1
        cluster.inflight[worker.index] += 1
        try:
            return await relay(request, cluster, worker, raw)
        except NotDelivered:  # refused: the worker is gone
            return routed_error(502, f"Worker {worker.index} could not be reached.", request.path)
        finally:
            cluster.inflight[worker.index] -= 1


def _pd_capable(body: dict) -> bool:
    if any(body.get(name) not in (None, False) for name in _NOT_PD):
        return False
    return body.get("n") in (None, 1) and body.get("best_of") in (None, 1)


class _Legs:
    """One P/D request: the prefill leg, then the decode leg (or its recompute retry)."""

    def __init__(self, routing, cluster, request, path, body, prefill, decode, fault) -> None:
        self.routing, self.cluster, self.request, self.path = routing, cluster, request, path
        self.body, self.prefill, self.decode, self.fault = body, prefill, decode, fault
        self.stream = bool(body.get("stream"))
        options = body.get("stream_options")
        self.client_usage = isinstance(options, dict) and bool(options.get("include_usage"))
        # Every chunk's usage so far (vLLM's continuous_usage_stats): rewritten per chunk.
        self.continuous = self.client_usage and bool(options.get("continuous_usage_stats"))
        self.prompt_usage: dict[str, Any] = {}  # the prefill's prompt counts
        self.completion_offset = 0  # first tokens a recompute leg counts as prompt
        self.transfer_id = uuid.uuid4().hex
        self.head: dict[str, Any] = {}  # id and created of the prefill answer
        self.first_text_chars = 0
        self.response: web.StreamResponse | None = None
        self._started_decode = False  # a decode leg's tokens reached the client
        self.decoded_by: PDProcess | None = None  # the worker whose decode leg ran

    def _body(self, kv: dict) -> bytes:
        body = {**self.body, "kv_transfer_params": kv}
        if self.stream:
            options = self.body.get("stream_options")
            options = options if isinstance(options, dict) else {}
            body["stream_options"] = {**options, "include_usage": True}
        return json.dumps(body).encode()

    async def run(self) -> web.StreamResponse:
        kv = {"do_remote_decode": True, "transfer_id": self.transfer_id,
              "decode_kv": f"{self.decode.kv_host}:{self.decode.kv_port}"}  # fmt: skip
        if self.fault is not None:
            kv["fault"] = self.fault
        if (link := getattr(self.routing, "link_faults", None)) is not None:  # cluster_faults
            kv = link.kv_params(self.decode, kv)
        try:
            first = await self._leg(self.prefill, self._body(kv), first_leg=True)
            if isinstance(first, web.StreamResponse):
                return first  # the prefill worker refused the request: its answer as it is
            p_usage, p_answer = first
            transfer = (p_usage or {}).get("kv_transfer")
            if transfer is None:  # ended at its first token: nothing to decode
                return await self._finish(p_usage, p_answer, None)
            rest = await self._decode_leg(transfer)
            d_usage, d_answer, retried = rest
            assert self.decoded_by is not None
            usage = _usage(p_usage, d_usage, transfer, retried, worker_name(self.decoded_by))
            return await self._finish(usage, p_answer, d_answer)
        except _Failed as failure:
            return await self._fail(failure)
        except ConnectionResetError:  # our client went away; leaving closes the worker's
            assert self.response is not None
            return self.response

    async def _decode_leg(self, transfer: dict):
        routing, decode = self.routing, self.decode
        if transfer.get("ok"):
            routing.transfers[(decode.index, "ok")] += 1
            routing.transfer_bytes[decode.index] += int(transfer.get("bytes") or 0)
            body = self._body({"do_remote_prefill": True, "transfer_id": self.transfer_id})
            self.decoded_by = decode
            try:
                d_usage, d_answer = await self._leg(decode, body)
                return d_usage, d_answer, None
            except _Failed:
                if self._started_decode:
                    raise  # tokens of this leg already reached the client: cannot retry
        elif transfer.get("error_kind") == "NoFreeBlocks":
            routing.transfers[(decode.index, "no_free_blocks")] += 1
            raise _Failed(503, transfer.get("error") or "No free KV blocks.", retry_after=1)
        else:
            routing.transfers[(decode.index, "failed")] += 1
        first_ids = transfer.get("first_token_ids") or []
        other = routing.least_loaded(self.cluster, routing.decode, avoid=decode.index)
        if not first_ids or other is None:
            reason = transfer.get("error") or "the decode worker failed"
            raise _Failed(502, f"The KV transfer failed and could not be retried: {reason}")
        routing.transfers[(other.index, "recomputed")] += 1
        body = self._body({"recompute_token_ids": first_ids})
        self.completion_offset, self.decoded_by = len(first_ids), other
        try:
            d_usage, d_answer = await self._leg(other, body)
        except _Failed as failure:
            message = f"The KV transfer failed and its recompute failed too: {failure.message}"
            raise _Failed(502, message) from None
        return d_usage, d_answer, len(first_ids)

    async def _leg(self, worker: PDProcess, body: bytes, *, first_leg: bool = False):
        """Send `body` to `worker`; stream its chunks on (a stream) or return its answer.
        Returns (usage, answer body or None) or, for a refused first leg, the response."""
        cluster = self.cluster
        assert cluster.session is not None
        cluster.routed[worker.index] += 1
        cluster.inflight[worker.index] += 1
        url = f"{worker.url}{self.request.path_qs}"
        headers = forwarded_headers(self.request.headers)
        try:
            async with cluster.session.post(url, data=body, headers=headers) as up:
                if up.status != 200:
                    answer = await up.read()
                    if first_leg:
                        headers = {
                            **forwarded_headers(up.headers),
                            WORKER_HEADER: worker_name(worker),
                        }
                        return web.Response(status=up.status, body=answer, headers=headers)
                    raise _Failed(
                        502, f"Worker {worker.index} answered {up.status}: {_reason(answer)}"
                    )
                if not self.stream:
                    answer = json.loads(await up.read())
                    return answer.get("usage"), answer
                return await self._relay_events(up, first_leg), None
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise _Failed(
                502, f"Worker {worker.index} ({worker.url}) was lost: {exc or type(exc).__name__}."
            ) from None
        finally:
            cluster.inflight[worker.index] -= 1

    async def _relay_events(self, up, first_leg: bool) -> dict | None:
        usage = None
        first_chunk = True
        async for line in up.content:
            if not line.startswith(b"data: "):
                continue
            data = line[len(b"data: ") :].strip()
            if data == b"[DONE]":
                continue
            event = json.loads(data)
            if "error" in event:
                raise _Failed(502, str(event["error"].get("message")))
            if not event.get("choices"):
                usage = event.get("usage")
                continue
            if not first_leg and first_chunk and "role" in event["choices"][0].get("delta", {}):
                first_chunk = False
                continue  # the decode worker's opening: the client has the prefill's
            first_chunk = False
            await self._write(self._chunk(event, first_leg))
            if not first_leg:
                self._started_decode = True
        return usage

    def _chunk(self, event: dict, first_leg: bool) -> dict:
        if first_leg:
            if not self.head:
                self.head = {"id": event["id"], "created": event["created"]}
        else:
            event.update(self.head)
        for choice in event["choices"]:
            if choice.get("finish_reason") == "handoff":
                choice["finish_reason"] = None
            text = choice.get("text")
            if text is None:
                text = (choice.get("delta") or {}).get("content") or ""
            if first_leg:
                self.first_text_chars += len(text)
            else:
                _shift_offsets(choice, self.first_text_chars)
        if not self.client_usage:
            event.pop("usage", None)
        elif self.continuous and isinstance(event.get("usage"), dict):
            event["usage"] = self._usage_so_far(event["usage"], first_leg)
        elif "usage" in event:
            event["usage"] = None
        return event

    def _usage_so_far(self, usage: dict, first_leg: bool) -> dict:
        """A chunk's usage as the single engine's: the prefill's prompt counts; every output
        token so far (a decode leg counts the first token, a recompute leg as prompt)."""
        if first_leg:
            self.prompt_usage = {
                k: usage[k] for k in ("prompt_tokens", "prompt_tokens_details") if k in usage
            }
            # The prefill worker's part ended (its `kv_memory`); the request goes on.
            return {k: v for k, v in usage.items() if k not in ("kv_memory", "kv_transfer")}
        completion = int(usage.get("completion_tokens", 0)) + self.completion_offset
        usage = {k: v for k, v in usage.items() if k != "kv_transfer"}  # the final usage's
        usage = {**usage, **self.prompt_usage, "completion_tokens": completion}
        usage["total_tokens"] = int(usage.get("prompt_tokens", 0)) + completion
        return usage

    async def _write(self, event: dict) -> None:
        if self.response is None:
            # The decode worker was chosen before the prefill leg: it names the response (a
            # recompute elsewhere names its worker in usage.kv_transfer.decode_worker).
            self.response = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                         WORKER_HEADER: worker_name(self.decode)}
            )  # fmt: skip
            await self.response.prepare(self.request)
        await self.response.write(f"data: {json.dumps(event)}\n\n".encode())

    async def _finish(self, usage, p_answer, d_answer) -> web.StreamResponse:
        if not self.stream:
            answer = p_answer if d_answer is None else _stitch(p_answer, d_answer, self.path)
            answer["usage"] = _client_usage(usage)
            served = self.prefill if self.decoded_by is None else self.decoded_by
            return web.json_response(answer, headers={WORKER_HEADER: worker_name(served)})
        if self.client_usage and usage is not None:
            chunk = {**self.head, "object": "chat.completion.chunk"
                     if self.path == "/v1/chat/completions" else "text_completion",
                     "model": self.body.get("model"), "choices": [],
                     "usage": _client_usage(usage)}  # fmt: skip
            await self._write(chunk)
        assert self.response is not None
        await self.response.write(b"data: [DONE]\n\n")
        await self.response.write_eof()
        return self.response

    async def _fail(self, failure: _Failed) -> web.StreamResponse:
        if self.response is None:  # nothing sent yet: an ordinary error answer
            answer = routed_error(failure.status, failure.message, self.path)
            if failure.retry_after is not None:
                answer.headers["Retry-After"] = str(failure.retry_after)
            return answer
        code = "no_free_blocks" if failure.status == 503 else "kv_transfer_failed"
        event = error_body(failure.message, type="server_error", code=code)
        try:
            await self.response.write(f"data: {json.dumps(event)}\n\n".encode())
            await self.response.write_eof()
        except ConnectionResetError:
            pass
        return self.response


def _reason(raw: bytes) -> str:
    try:
        return str(json.loads(raw)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return raw[:200].decode(errors="replace")


def _shift_offsets(choice: dict, num_chars: int) -> None:
    """A completions choice's logprobs `text_offset`s counted from the whole text's start."""
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, dict) and isinstance(logprobs.get("text_offset"), list):
        logprobs["text_offset"] = [o + num_chars for o in logprobs["text_offset"]]


def _usage(
    p_usage: dict, d_usage: dict | None, transfer: dict, retried: int | None, decode_worker: str
) -> dict:
    """One usage for the whole request: the prefill's prompt, every output token, the
    transfer with the decode worker's name and its install time (null after a recompute)."""
    usage = dict(d_usage or {})
    installed = usage.pop("kv_transfer", None)
    install_ms = installed.get("install_ms") if isinstance(installed, dict) else None
    completion = int(usage.get("completion_tokens", 0)) + (retried or 0)
    usage.update(
        prompt_tokens=p_usage["prompt_tokens"],
        completion_tokens=completion,
        total_tokens=p_usage["prompt_tokens"] + completion,
    )
    if "prompt_tokens_details" in p_usage:
        usage["prompt_tokens_details"] = p_usage["prompt_tokens_details"]
    usage["kv_transfer"] = {
        **transfer, "retried": "recompute" if retried else None,
        "decode_worker": decode_worker, "install_ms": install_ms,
    }  # fmt: skip
    return usage


def _client_usage(usage: dict | None) -> dict | None:
    if usage is None or "kv_transfer" not in usage:
        return usage
    kv = {k: v for k, v in usage["kv_transfer"].items() if k not in _INTERNAL}
    return {**usage, "kv_transfer": kv}


def _stitch(first: dict, rest: dict, path: str) -> dict:
    """One non-streamed answer from the prefill's (first tokens) and the decode's (the rest)."""
    answer = {**rest, "id": first["id"], "created": first["created"]}
    a, b = first["choices"][0], dict(rest["choices"][0])
    if path == "/v1/chat/completions":
        message = dict(b["message"])
        message["content"] = (a["message"].get("content") or "") + (message.get("content") or "")
        b["message"] = message
        if a.get("logprobs") and b.get("logprobs"):
            b["logprobs"] = {"content": a["logprobs"]["content"] + b["logprobs"]["content"]}
    else:
        b["text"] = a["text"] + b["text"]
        la, lb = a.get("logprobs"), b.get("logprobs")
        if la and lb:  # a complete body counts offsets by the tokens' own strings
            _shift_offsets(b, sum(len(token) for token in la["tokens"]))
            b["logprobs"] = {k: la[k] + lb[k] for k in la}
    if a.get("token_ids") is not None and b.get("token_ids") is not None:
        b["token_ids"] = a["token_ids"] + b["token_ids"]
    answer["choices"] = [b]
    return answer


class _Families:
    def __init__(self, families: list) -> None:
        self.families = families

    def collect(self) -> list:
        return self.families


async def serve_pd_cluster(
    config: ServerConfig,
    *,
    prefill_workers: int,
    decode_workers: int,
    log_level: str = "warning",
    on_listening: Callable[[str], None] | None = None,
    stop: asyncio.Event | None = None,
    park_timeout_s: float = 30.0,
    install_wait_s: float = 10.0,
    ray_address: str | None = None,
) -> None:
    """Start the P/D workers (as Ray actors with `ray_address`), serve the router in P/D mode
    on `config`'s host and port until `stop` is set, then stop every worker (on every exit)."""
    loop = asyncio.get_running_loop()
    start = functools.partial(
        start_pd_workers, config, prefill_workers, decode_workers, log_level=log_level,
        park_timeout_s=park_timeout_s, install_wait_s=install_wait_s, ray_address=ray_address,
    )  # fmt: skip
    workers = await loop.run_in_executor(None, start)
    try:
        routing = PDRouting(workers, fault_injection=config.enable_fault_injection)
        cluster = Cluster(workers, make_policy("least-loaded"), config, None, pd=routing)
        what = f"routing to {len(workers)} P/D workers"
        await serve_app(create_router_app(cluster), config, on_listening, stop, what)
    finally:
        await loop.run_in_executor(None, stop_pd_workers, workers)

"""KV handoff between two reference engines: prefill on one, decode on another (P/D).

Prefill side (`HandoffExporter`, over one engine): a request added through it runs its prompt
and samples its first token as any request does; the step that samples it returns that token
with finish_reason "handoff" (so it streams as soon as prefill is done), and instead of decoding
on, the request leaves the scheduler with its blocks still referenced: pinned, so `export` can
copy them out (again, for a retry) into a `KVHandoff` until `release` drops them. A request that
ends at its first token (a stop token, max_tokens 1) ends as usual and holds nothing. Drive the
engine with `exporter.step()`; a plain `engine.step()` would decode those requests on.

Decode side (`install(engine, request_id, handoff, params)`): checks that the handoff fits the
engine (model fingerprint, layers, KV heads, head_dim; one sentence when not), converts its
layout (`core.kv_layout`: blocks re-cut by token position when the block sizes differ; K/V cast or
(de)quantised when the KV dtypes differ), allocates the blocks, writes them, and only then puts
the request in the scheduler's running set as a decode: its next token comes from
`engine.step()`. Without enough free blocks it raises `NoFreeBlocks` before anything is
allocated or added, so a caller can wait and retry. Installing a request id that is already
live with the same tokens is a no-op; `free` (an abort) and `release` are idempotent.

What a handoff carries to continue exactly: the tokens (prompt and output so far), how many of
them have KV (all but the last sampled one), the output text already emitted (`stop` strings
are searched from there) and a seeded request's generator state (an unseeded request draws
from the engine's own generator, so its continuation is random either way). The model
fingerprint binds what the prefix cache's salt binds except the KV dtype (the salt, the
tokenizer, the model name) plus the compute dtype and the weight quantization: KV from another
model, or computed in another dtype, is refused rather than converted.

Converted and lossy installs: KV in another dtype than the decode engine's pool is dequantised
to float32 and cast, or quantised by the pool's own rule (`converted`); `Installed.lossy` says
whether that changed any value (e.g. float32 into int8 or bf16; int8, fp8 or bf16 into float32
keeps them). Even a lossless conversion is not what the decode engine would have computed
itself (a lossy-KV engine's prefill attends over its own rounded KV, so its deeper layers' KV
differs), so converted blocks are cached under their own cache salt: the decode engine's
prefix cache never serves them to another request as its own KV. Same dtype, any block sizes:
exact, and cached as usual.

Not supported (one sentence each): n > 1, beam search, guided decoding, a sequence that has
evicted KV (`core.kv_eviction`). An install passes the engine's admission like any request
(`add_request`: its checks, the waiting bound, deadlines), then leaves the waiting queue at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine_ref.core import kv_layout
from engine_ref.core.admission import EngineError
from engine_ref.core.engine_config import SamplingParams
from engine_ref.core.kv_dtype import KVFormat
from engine_ref.core.outputs import RequestOutput
from engine_ref.core.sequence import Request, Sequence, SequenceStatus

if TYPE_CHECKING:
    from engine_ref.core.kv_landing import Landing

__all__ = [
    "KV_STORAGE",
    "HandoffExporter",
    "Installed",
    "KVBlock",
    "KVHandoff",
    "KVHandoffError",
    "NoFreeBlocks",
    "blocks_needed",
    "free",
    "install",
    "model_fingerprint",
]

# The KV storage dtypes a handoff may name (`KVFormat.name` of every pool format).
KV_STORAGE = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int8": torch.int8,
    "float8_e4m3fn": torch.float8_e4m3fn,
}


class KVHandoffError(EngineError):
    """A handoff this engine cannot export or install; the message is one sentence."""


class NoFreeBlocks(KVHandoffError):
    """The decode engine lacks `needed` free blocks (it has `free`); nothing was allocated,
    so the caller may wait for blocks to free and install again."""

    def __init__(self, needed: int, free: int) -> None:
        super().__init__(
            f"The handoff needs {needed} free KV blocks and this engine has {free}; "
            "retry once requests finish."
        )
        self.needed, self.free = needed, free


@dataclass(frozen=True)
class KVBlock:
    """One block's KV in every layer, as the prefill engine's pool stores it: `kv`
    [num_layers, 2 * num_kv_heads, num_tokens, head_dim] (key heads, then value heads) in the
    storage dtype, and for int8/fp8 pools `scales` [num_layers, 2 * num_kv_heads, num_tokens]
    float32 (one per row); the last block may hold fewer tokens than the block size."""

    kv: torch.Tensor
    scales: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.kv.shape[2]

    def keys(self, layer: int) -> torch.Tensor:  # [num_kv_heads, num_tokens, head_dim]
        return self.kv[layer, : self.kv.shape[1] // 2]

    def values(self, layer: int) -> torch.Tensor:
        return self.kv[layer, self.kv.shape[1] // 2 :]


@dataclass(frozen=True)
class KVHandoff:
    """A request's state after prefill, to continue on another engine (module doc). The first
    `num_computed_tokens` of `token_ids` have KV, in `blocks` of `block_size` tokens."""

    request_id: str
    model_fingerprint: str
    block_size: int
    kv_dtype: str  # a key of KV_STORAGE
    num_layers: int
    num_kv_heads: int
    head_dim: int
    token_ids: tuple[int, ...]
    num_prompt_tokens: int
    num_computed_tokens: int
    blocks: tuple[KVBlock, ...]
    generator_state: bytes | None = None  # a seeded request's torch.Generator state
    generator_device: str = "cpu"  # the device type that state is for
    num_emitted_chars: int = 0  # output text already returned to the caller

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def kv_nbytes(self) -> int:
        """Bytes of K/V (and scales) the blocks hold."""
        return sum(
            _nbytes(b.kv) + (0 if b.scales is None else _nbytes(b.scales)) for b in self.blocks
        )


@dataclass(frozen=True)
class Installed:
    """What `install` did: the blocks it allocated, whether it converted the KV dtype and
    whether that changed values (`lossy`; module doc), and `already_installed` for a no-op."""

    request_id: str
    num_blocks: int
    converted: bool
    lossy: bool
    already_installed: bool = False


def model_fingerprint(engine) -> str:
    """What the KV of a token depends on besides the tokens and the KV dtype (module doc)."""
    config = engine.config
    return (
        f"{config.prefix_cache_salt}|{engine.tokenizer.name}|{config.model}|{engine.dtype}"
        f"|quantization={config.quantization}"
    )


# -- prefill side -------------------------------------------------------------------------------
class HandoffExporter:
    """The prefill side over `engine` (module doc): `add_request`, `step`, `export`, `release`."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self._prefilling: set[str] = set()  # added here, first token not sampled yet
        self._held: dict[str, Sequence] = {}  # first token out, blocks pinned

    @property
    def held(self) -> list[str]:
        """The request ids whose blocks are pinned for export."""
        return list(self._held)

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, **kwargs
    ) -> None:
        """`engine.add_request` (same arguments and errors) for a request to hand off after
        its first token; raises KVHandoffError for what a handoff cannot carry."""
        if problem := _params_problem(params):
            raise KVHandoffError(problem)
        if request_id in self._held:
            raise EngineError(f"Request id {request_id!r} is already in use.")
        self.engine.add_request(request_id, prompt_token_ids, params, **kwargs)
        self._prefilling.add(request_id)

    def step(self) -> list[RequestOutput]:
        """`engine.step()`; a handoff request whose first token this step sampled comes back
        finished with finish_reason "handoff", its blocks held for `export`."""
        engine = self.engine
        outputs = engine.step()
        for output in outputs:
            request_id = output.request_id
            if request_id not in self._prefilling:
                continue
            self._prefilling.discard(request_id)
            if output.finished:
                continue  # ended at its first token (or aborted, failed): nothing to hand off
            request = engine.requests.pop(request_id)
            seq = request.sequences[0]
            engine.scheduler.running.remove(seq)  # off the scheduler, its blocks still held
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, "handoff"
            self._held[request_id] = seq
            output.finished = True
            output.outputs[0].finish_reason = "handoff"
            accounting = engine.kv_accounting
            acc = accounting.requests.pop(request_id, None)
            output.kv_memory = None if acc is None else acc.report(accounting.geometry)
        return outputs

    def export(
        self, request_id: str, allocate: Callable[[int], torch.Tensor] | None = None
    ) -> KVHandoff:
        """A copy of a held request's KV and state (its blocks stay held until `release`);
        `allocate(nbytes)` gives the uint8 buffer the blocks' copies go into
        (`kv_layout.gather`)."""
        seq = self._held.get(request_id)
        if seq is None:
            if request_id in self._prefilling:
                raise KVHandoffError(
                    f"Request {request_id!r} has not sampled its first token yet; step until "
                    "it has."
                )
            raise KVHandoffError(
                f"Request {request_id!r} is not held for a handoff (unknown, released, or it "
                "finished on this engine)."
            )
        if seq.kv_evicted_tokens:
            raise KVHandoffError(
                f"Request {request_id!r} has evicted KV (kv_eviction); only exact KV is handed off."
            )
        engine = self.engine
        runner = engine.model_runner
        mc = engine.model_config
        generator = seq.generator
        return KVHandoff(
            request_id=request_id,
            model_fingerprint=model_fingerprint(engine),
            block_size=engine.config.block_size,
            kv_dtype=runner.kv_format.name,
            num_layers=mc.num_hidden_layers,
            num_kv_heads=mc.num_key_value_heads,
            head_dim=mc.head_dim,
            token_ids=tuple(seq.token_ids),
            num_prompt_tokens=seq.num_prompt_tokens,
            num_computed_tokens=seq.num_computed_tokens,
            blocks=tuple(
                KVBlock(kv, scales)
                for kv, scales in kv_layout.gather(
                    runner.kv_caches,
                    runner.kv_format,
                    seq.block_table,
                    seq.num_computed_tokens,
                    engine.config.block_size,
                    allocate,
                )
            ),
            generator_state=None if generator is None else generator.get_state().numpy().tobytes(),
            generator_device=engine.device.type,
            num_emitted_chars=seq.num_emitted_chars,
        )

    def release(self, request_id: str) -> None:
        """Free a held request's blocks, or abort it while it is still prefilling; unknown and
        released ids are ignored."""
        seq = self._held.pop(request_id, None)
        if seq is not None:
            self.engine.block_manager.free(seq)
        elif request_id in self._prefilling:
            self._prefilling.discard(request_id)
            self.engine.abort(request_id)


# -- decode side --------------------------------------------------------------------------------
def blocks_needed(engine, handoff: KVHandoff) -> int:
    """Free blocks `install` takes on `engine` (its block size, the handoff's tokens)."""
    return -(-handoff.num_computed_tokens // engine.config.block_size)


def install(
    engine,
    request_id: str,
    handoff: KVHandoff,
    params: SamplingParams,
    *,
    priority: int = 0,
    cache_salt: str | None = None,
    tenant: str | None = None,
    landing: Landing | None = None,
) -> Installed:
    """Install `handoff` on `engine` as running request `request_id` with `params` (the
    request's own, `max_tokens` counting the tokens already sampled); module doc. Raises
    KVHandoffError (one sentence) for a handoff that does not fit, NoFreeBlocks, and what
    `engine.add_request` raises; in every case nothing is left allocated or added. With a
    `landing` (`core.kv_landing`, reserved for this handoff) its blocks become the request's,
    the ones not written yet written now; whatever happens, the landing is used or released."""
    try:
        installed = _install(
            engine, request_id, handoff, params, priority, cache_salt, tenant, landing
        )
    finally:
        if landing is not None:
            landing.release(engine.block_manager)  # a no-op once the request holds them
    return installed


def _install(
    engine, request_id, handoff, params, priority, cache_salt, tenant, landing
) -> Installed:
    runner = engine.model_runner
    existing = engine.requests.get(request_id)
    if existing is not None and not _is_installed(existing, handoff):
        raise KVHandoffError(f"Request id {request_id!r} is already in use by another request.")
    if problem := _params_problem(params) or _fit_problem(engine, handoff, params):
        raise KVHandoffError(problem)
    bm = engine.block_manager
    needed = blocks_needed(engine, handoff)
    if landing is not None and (landing.released or len(landing.blocks) != needed):
        landing = None  # not this handoff's: given back by the caller
    if existing is None and landing is None and needed > bm.num_free_blocks:
        raise NoFreeBlocks(needed, bm.num_free_blocks)
    blocks = [(b.kv, b.scales) for b in handoff.blocks]
    converted = bool(blocks) and blocks[0][0].dtype != runner.kv_format.storage
    kv = scales = None
    lossy = False
    if converted or handoff.block_size != engine.config.block_size:
        source = kv_layout.join(blocks)
        kv, scales = kv_layout.convert(*source, runner.kv_format.storage)
        lossy = converted and not torch.equal(
            kv_layout.dequantize(kv, scales), kv_layout.dequantize(*source)
        )
    if existing is not None:
        table = existing.sequences[0].block_table
        return Installed(request_id, len(table), converted, lossy, already_installed=True)
    if converted:  # not this engine's own KV: its blocks never serve another request
        cache_salt = repr((cache_salt, "kv-handoff", handoff.kv_dtype))
    prompt = list(handoff.token_ids[: handoff.num_prompt_tokens])
    engine.add_request(
        request_id, prompt, params, priority=priority, cache_salt=cache_salt, tenant=tenant
    )
    request = engine.requests[request_id]
    try:
        seq = _running_sequence(engine, request, handoff)
        written = 0
        if landing is not None and not converted and handoff.block_size == bm.block_size:
            seq.block_table, written = list(landing.blocks), landing.written
            landing.released = True  # the request holds them now: its abort frees them
        else:
            bm.append_slots(seq, handoff.num_computed_tokens)  # `needed` fresh blocks
        if converted or handoff.block_size != engine.config.block_size:
            blocked = kv_layout.reblock(kv, scales, engine.config.block_size)
            kv_layout.write(runner.kv_caches, seq.block_table, *blocked)
        else:  # this engine's own layout: each block straight into its slot
            kv_layout.write_blocks(runner.kv_caches, seq.block_table[written:], blocks[written:])
        seq.num_computed_tokens = handoff.num_computed_tokens
        bm.register_full_blocks(seq)
    except BaseException:
        engine.requests.pop(request_id, None)
        engine.output_processor.finish(request, "abort")  # frees what was allocated
        raise
    return Installed(request_id, needed, converted, lossy)


def free(engine, request_id: str) -> None:
    """Drop an installed request and its blocks (`engine.abort`: the next step returns it with
    finish_reason "abort"); unknown and finished ids are ignored."""
    engine.abort(request_id)


def _params_problem(params: SamplingParams) -> str | None:
    if params.n != 1 or params.use_beam_search:
        return "A KV handoff carries one sequence; n > 1 and beam search are not supported."
    if params.guided is not None:
        return "A KV handoff does not carry a grammar's state; guided decoding is not supported."
    return None


def _fit_problem(engine, handoff: KVHandoff, params: SamplingParams) -> str | None:
    """One sentence when `handoff` cannot be installed on `engine`, else None."""
    mc = engine.model_config
    ours = (mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim)
    theirs = (handoff.num_layers, handoff.num_kv_heads, handoff.head_dim)
    fingerprint = model_fingerprint(engine)
    if theirs != ours:
        return (
            f"The handoff's KV has {theirs[0]} layers, {theirs[1]} KV heads and head_dim "
            f"{theirs[2]}, but this engine's model has {ours[0]}, {ours[1]} and {ours[2]}."
        )
    if handoff.model_fingerprint != fingerprint:
        return (
            f"The handoff's KV was computed by {handoff.model_fingerprint!r}, but this engine "
            f"serves {fingerprint!r}; hand it to an engine of the same model and dtype."
        )
    if handoff.kv_dtype not in KV_STORAGE:
        return f"Unknown KV dtype {handoff.kv_dtype!r}; expected one of {', '.join(KV_STORAGE)}."
    tokens, n = handoff.token_ids, handoff.num_computed_tokens
    if not 0 < handoff.num_prompt_tokens <= n < len(tokens):
        return (
            f"The handoff has {len(tokens)} tokens ({handoff.num_prompt_tokens} of prompt) and KV "
            f"for {n}; it needs KV for the whole prompt and at least one token to decode."
        )
    if min(tokens) < 0 or max(tokens) >= mc.vocab_size:
        return f"The handoff's token ids must be in [0, {mc.vocab_size})."
    if len(tokens) >= engine.max_model_len:
        return (
            f"The handoff has {len(tokens)} tokens; this engine serves fewer than "
            f"{engine.max_model_len}."
        )
    if params.max_tokens <= handoff.num_output_tokens:
        return (
            f"max_tokens is {params.max_tokens} but the handoff already has "
            f"{handoff.num_output_tokens} output tokens; nothing is left to decode."
        )
    if (handoff.generator_state is None) != (params.seed is None or params.is_greedy):
        return (
            "The handoff's generator state does not match the params' seed; pass the "
            "request's own params."
        )
    if handoff.generator_state is not None and handoff.generator_device != engine.device.type:
        return (
            f"A seeded request's generator state from {handoff.generator_device} cannot continue "
            f"on {engine.device.type}; hand it to an engine on the same device type."
        )
    storage = KV_STORAGE[handoff.kv_dtype]
    row = (2 * handoff.num_kv_heads, handoff.head_dim)
    counts = [b.num_tokens for b in handoff.blocks]
    bs = handoff.block_size
    if counts != [min(bs, n - i) for i in range(0, n, bs)] or any(
        b.kv.dtype != storage
        or (b.kv.shape[0], b.kv.shape[1], b.kv.shape[3]) != (handoff.num_layers, *row)
        or (b.scales is None) != (not KVFormat(storage).scaled)
        for b in handoff.blocks
    ):
        return "The handoff's blocks do not match its block size, token count, KV dtype or shapes."
    return None


def _is_installed(request: Request, handoff: KVHandoff) -> bool:
    """The live `request` continues `handoff`: same prompt, its tokens so far extend them."""
    tokens = request.sequences[0].token_ids
    return (
        tuple(request.prompt_token_ids) == handoff.token_ids[: handoff.num_prompt_tokens]
        and tuple(tokens[: len(handoff.token_ids)]) == handoff.token_ids
    )


def _running_sequence(engine, request: Request, handoff: KVHandoff) -> Sequence:
    """Replace the waiting sequence `add_request` made by a running one at the handoff's
    state (no blocks yet): it decodes from the next step on."""
    placeholder = request.sequences[0]
    generator = placeholder.generator
    if generator is not None and handoff.generator_state is not None:
        state = torch.frombuffer(bytearray(handoff.generator_state), dtype=torch.uint8)
        try:
            generator.set_state(state)
        except RuntimeError:
            raise KVHandoffError(
                "The handoff's generator state is not one this engine's generator can take."
            ) from None
    engine.scheduler.remove(placeholder)  # off the waiting queue (its entry is skipped)
    prompt = list(handoff.token_ids[: handoff.num_prompt_tokens])
    seq = engine.output_processor.new_sequence(request, 0, prompt, generator)
    for token in handoff.token_ids[handoff.num_prompt_tokens :]:
        seq.detokenizer.add([token])  # one by one, as the prefill engine did
        seq.token_ids.append(token)
    seq.num_emitted_chars = handoff.num_emitted_chars
    request.sequences[0] = seq
    seq.status = SequenceStatus.RUNNING
    engine.scheduler.running.append(seq)
    return seq


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()

"""`ModelRunner`: the model, its KV pools and one forward over a scheduled batch.

It owns what runs on the device: the target model built from an already loaded state dict
(loading files is `engine_ref.loading`'s job), the pools sized from the config (one per layer,
`num_blocks` blocks of `block_size` tokens) and the context length they bound, the attention
metadata, the forward (a batch's decode rows, prefill chunks and verify rows flattened into one
input, the model, then the logits of the rows that sample or verify), the drafter that fills
model drafts, and copies and moves of KV slots. Sampling and everything after it is
`output_processor.py`'s.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from engine_ref.core import kv_dtype
from engine_ref.core.admission import EngineError
from engine_ref.core.attention import AttentionMetadata, build_attention_metadata, kv_pool_shape
from engine_ref.core.config import ModelConfig
from engine_ref.core.engine_config import EngineConfig
from engine_ref.core.kv_accounting import KVGeometry
from engine_ref.core.kv_dtype import KVPool, allocate_pools, resolve_kv_format
from engine_ref.core.model import LlamaModel
from engine_ref.core.quant import QuantizationError, weight_bytes_by_kind
from engine_ref.core.sequence import Sequence
from engine_ref.core.spec_decode import DraftTree, SpeculativeDecoder
from engine_ref.core.spec_decode.drafter import ModelDrafter, build_draft_model

__all__ = ["ForwardOutput", "ModelRunner", "device_index", "prepare_device", "release_freed_heap"]

logger = logging.getLogger(__name__)


@dataclass
class ForwardOutput:
    """A forward over `items` ((sequence, new tokens) in batch order), nothing committed.
    `logits` [N + S, V] holds a row for each of `sampling_seqs` (N), then k + 1 rows for each
    of `verifying` ((sequence, its token tree's parents or None for a chain), k drafts each);
    None when no row samples (prefill chunks that end inside their prompts)."""

    items: list[tuple[Sequence, int]]
    num_prompt_rows: int = 0
    sampling_seqs: list[Sequence] = field(default_factory=list)
    verifying: list[tuple[Sequence, list[int] | None]] = field(default_factory=list)
    logits: torch.Tensor | None = None


def prepare_device(config: EngineConfig) -> torch.device:
    """The config's device, after checking CUDA is there and setting torch's CPU threads
    (before loading, which they speed up). Raises EngineError when CUDA is asked for and
    missing."""
    device = config.torch_device()
    if device.type == "cuda" and not torch.cuda.is_available():
        raise EngineError("CUDA is not available on this machine; use device='cpu'.")
    if device.type == "cpu":
        torch.set_num_threads(config.threads())
    return device


def release_freed_heap() -> None:
    """Return the malloc heap's free pages to the system (glibc's `malloc_trim`, ~1 ms; a
    no-op elsewhere). No gc.collect(): the load's tensors go by reference counting, and a
    collection in a process with a large heap costs hundreds of ms."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def device_index(rows: list[int], device: torch.device) -> torch.Tensor:
    """`rows` as a long tensor on `device`, for index_select and index_copy_."""
    # dtype explicit: torch.tensor([]) is float32, which index_select rejects.
    return torch.tensor(rows, dtype=torch.long).to(device, non_blocking=True)


class ModelRunner:
    """The target model of `loaded` (an `engine_ref.loading.LoadedModel`, or anything with
    `config`, `state_dict` and `tokenizer`) with its KV pools, and the drafter a speculative
    config asks for (a `draft_model` needs `draft_loaded`, loaded the same way). Raises
    EngineError for a config the model or the memory cannot serve."""

    def __init__(self, config: EngineConfig, loaded: Any, draft_loaded: Any = None) -> None:
        self.config = config
        self.device = prepare_device(config)
        self.dtype = config.torch_dtype()
        self.model_config = mc = loaded.config
        max_len = config.max_model_len or mc.max_position_embeddings
        try:
            self.model = LlamaModel.from_state_dict(
                mc,
                loaded.state_dict,
                dtype=self.dtype,
                device=self.device,
                max_positions=max_len,
                quantization=config.quantization,
                int4_weights=getattr(loaded, "int4_weights", None),
            )
        except QuantizationError as exc:
            raise EngineError(str(exc)) from None
        self.weight_bytes_by_kind = weight_bytes_by_kind(self.model)
        # How the pools store K/V (`kv_cache_dtype`); the bytes count values and scales.
        self.kv_format = resolve_kv_format(config.kv_cache_dtype, self.dtype)
        self.kv_bytes_per_token = self.kv_format.bytes_per_token(
            mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim
        )
        bs = config.block_size
        self.num_blocks = config.num_blocks or config.kv_cache_memory_bytes // (
            self.kv_bytes_per_token * bs
        )
        if self.num_blocks < 2:
            raise EngineError(
                f"kv_cache_memory_bytes={config.kv_cache_memory_bytes} holds fewer than 2 blocks; "
                "raise it or set num_blocks."
            )
        self.max_model_len = min(max_len, self.num_blocks * bs)
        # One pool per layer, head-major (see attention.py), zeroed.
        pool_shape = kv_pool_shape(self.num_blocks, bs, mc.num_key_value_heads, mc.head_dim)
        self.kv_caches: list[KVPool] = allocate_pools(
            self.kv_format, pool_shape, self.device, mc.num_hidden_layers
        )
        # What a block's KV depends on beyond its tokens and the model: the dtype it was
        # computed in and the one it is stored in (the prefix cache's salt binds both).
        self.kv_cache_key = f"{self.dtype}|kv={self.kv_format.name}"
        self.drafter = self._build_drafter(loaded.tokenizer, draft_loaded)
        # Building the model (dequantising, fusing, quantising) frees hundreds of MB of
        # temporaries in the middle of the malloc heap, which glibc keeps; hand them back (on
        # SmolLM2 W4A16 the engine's RSS went from 2.7 to 1.6 GB, 1 GB of it the KV pool).
        del loaded, draft_loaded
        release_freed_heap()

    def kv_geometry(self) -> KVGeometry:
        """The shapes memory per request is accounted with (`core.kv_accounting`)."""
        mc = self.model_config
        return KVGeometry(
            num_layers=mc.num_hidden_layers, num_kv_heads=mc.num_key_value_heads,
            num_heads=mc.num_attention_heads, head_dim=mc.head_dim, hidden_size=mc.hidden_size,
            intermediate_size=mc.intermediate_size, vocab_size=mc.vocab_size,
            block_size=self.config.block_size, kv_bytes_per_token=self.kv_bytes_per_token,
            activation_bytes=torch.empty((), dtype=self.dtype).element_size(),
        )  # fmt: skip

    @property
    def kv_pool_bytes(self) -> int:
        """Bytes every layer's pool holds, values and scales (the draft model's not counted)."""
        return sum(kv_dtype.pool_nbytes(pool) for pool in self.kv_caches)

    @property
    def kv_bytes_per_request(self) -> int:
        """The KV bytes of a request of `max_model_len` tokens (whole blocks)."""
        bs = self.config.block_size
        return -(-self.max_model_len // bs) * bs * self.kv_bytes_per_token

    def _build_drafter(self, tokenizer: Any, draft_loaded: Any) -> ModelDrafter | None:
        spec = self.config.speculative_config
        mc = self.model_config
        if spec is None or spec.method == "ngram":
            return None
        if spec.method == "self_draft":
            if spec.num_draft_layers > mc.num_hidden_layers:
                raise EngineError(
                    f"num_draft_layers={spec.num_draft_layers} exceeds the model's "
                    f"{mc.num_hidden_layers} layers; use at most that many."
                )
            layers = spec.num_draft_layers
            return ModelDrafter(
                self.model, self.kv_caches[:layers], mc, self.metadata, num_layers=layers
            )
        if draft_loaded is None:
            raise EngineError(
                f"The draft model {spec.model!r} is not loaded; pass draft_loaded, or build "
                "the engine with engine_ref.build_engine, which loads it."
            )
        model, caches, draft_config = build_draft_model(
            spec.model,
            draft_loaded,
            target_tokenizer=tokenizer,
            target_vocab_size=mc.vocab_size,
            num_blocks=self.num_blocks,
            block_size=self.config.block_size,
            max_positions=self.max_model_len,
            dtype=self.dtype,
            device=self.device,
        )
        return ModelDrafter(model, caches, draft_config, self.metadata, owns_kv=True)

    def metadata(
        self,
        starts: list[int],
        num_new_tokens: list[int],
        block_tables: list[list[int]],
        mc: ModelConfig | None = None,
        tree_masks: dict[int, torch.Tensor] | None = None,
        kv_evicted: bool = False,
    ) -> AttentionMetadata:
        """Attention metadata for the target (or the model config `mc`'s heads)."""
        mc = mc or self.model_config
        return build_attention_metadata(
            start_positions=starts,
            num_new_tokens=num_new_tokens,
            block_tables=block_tables,
            block_size=self.config.block_size,
            num_queries_per_kv=mc.num_attention_heads // mc.num_key_value_heads,
            num_kv_heads=mc.num_key_value_heads,
            num_pool_blocks=self.num_blocks,
            device=self.device,
            dtype=self.dtype,
            tree_masks=tree_masks,
            kv_evicted=kv_evicted,
        )

    def forward(self, items: list[tuple[Sequence, int]]) -> ForwardOutput:
        """Run `items` through the model and compute the logits of the rows that sample or
        verify; changes nothing but the KV slots of their new tokens (and a draft model's)."""
        out = ForwardOutput(items)
        input_ids: list[int] = []
        positions: list[int] = []
        starts: list[int] = []
        num_new_tokens: list[int] = []
        sample_rows: list[int] = []
        spec_rows: list[int] = []
        tree_masks: dict[int, torch.Tensor] = {}
        for item_index, (seq, n) in enumerate(items):
            start = seq.num_computed_tokens
            # Attention works in kept positions; RoPE takes the text ones (`core.kv_eviction`).
            starts.append(start - seq.kv_evicted_tokens)
            num_new_tokens.append(n)
            if seq.draft_token_ids and n > 1 and start == seq.num_tokens - 1:
                # A verify row: the last token, then the drafts; every row's logits count.
                assert len(seq.draft_token_ids) == n - 1
                spec_rows += range(len(input_ids), len(input_ids) + n)
                input_ids += [seq.token_ids[start], *seq.draft_token_ids]
                parents = seq.draft_parents
                if parents is None:
                    positions += range(start, start + n)
                else:  # a token tree: nodes at their depth's position, in consecutive slots
                    tree = DraftTree(seq.draft_token_ids, parents)
                    positions += [start, *(start + d for d in tree.depths)]
                    tree_masks[item_index] = torch.tensor(tree.ancestry_mask())
                    parents = list(parents)
                out.verifying.append((seq, parents))
                continue
            input_ids += seq.token_ids[start : start + n]
            positions += range(start, start + n)
            if start < seq.num_prompt_tokens or n > 1:
                out.num_prompt_rows += n
            if start + n == seq.num_tokens:
                sample_rows.append(len(input_ids) - 1)
                out.sampling_seqs.append(seq)
        tables = [seq.block_table for seq, _ in items]
        evicted = any(seq.kv_evicted_tokens for seq, _ in items)
        meta = self.metadata(
            starts, num_new_tokens, tables, tree_masks=tree_masks, kv_evicted=evicted
        )
        ids = torch.tensor(input_ids, dtype=torch.long).to(self.device, non_blocking=True)
        pos = torch.tensor(positions, dtype=torch.long).to(self.device, non_blocking=True)
        hidden = self.model(ids, pos, meta, self.kv_caches)  # [T, D]
        if self.drafter is not None:  # a draft model keeps its KV of every computed position
            self.drafter.follow(ids, pos, starts, num_new_tokens, tables)
        if not out.sampling_seqs and not out.verifying:
            return out
        wanted_rows = sample_rows + spec_rows
        if len(wanted_rows) < len(input_ids):
            hidden = hidden.index_select(0, device_index(wanted_rows, self.device))
        out.logits = self.model.compute_logits(hidden)  # [N + S, V]
        return out

    def fill_drafts(self, spec: SpeculativeDecoder, scheduled: list[Sequence]) -> None:
        """Draft into the slots the scheduler granted the sequences of `scheduled` that draft.
        A drafter that fails costs its speedup, never an output: verification is lossless
        whatever the drafts, so they become copies of the last token."""
        seqs = [seq for seq in scheduled if seq.num_lookahead_tokens]
        try:
            assert self.drafter is not None or spec.config.method == "ngram"
            next_tokens = self.drafter.next_tokens if self.drafter is not None else None
            spec.fill_drafts(seqs, next_tokens)
        except Exception:
            logger.warning("the draft model failed; drafting the last token", exc_info=True)
            for seq in seqs:
                seq.draft_token_ids = [seq.token_ids[-1]] * seq.num_lookahead_tokens

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks (source, destination) in every layer's pool (copy-on-write)."""
        if not copies:
            return
        src = device_index([s for s, _ in copies], self.device)
        dst = device_index([d for _, d in copies], self.device)
        for pool in self.kv_caches:
            kv_dtype.copy_blocks(pool, src, dst)

    def move_accepted_kv(self, seq: Sequence, start: int, path: list[int]) -> None:
        """A token tree's accepted path: node i's KV was written at slot start + 1 + i; the
        sequence needs its j-th accepted token's at start + 1 + j (j <= i, so no move
        overwrites a source still to be read)."""
        moves = [(start + 1 + node, start + 1 + j) for j, node in enumerate(path) if node != j]
        if not moves:
            return
        bs = self.config.block_size
        table = seq.block_table

        def slot(pos: int) -> int:
            return table[pos // bs] * bs + pos % bs

        src = device_index([slot(s) for s, _ in moves], self.device)
        dst = device_index([slot(d) for _, d in moves], self.device)
        for pool in self.kv_caches:
            kv_dtype.copy_slots(pool, src, dst)

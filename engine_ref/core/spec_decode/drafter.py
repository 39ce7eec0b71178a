"""Model drafters: greedy point drafts from a Llama model over the engine's paged KV.

The self-speculative draft is the target's first L layers with its final norm and head; its
KV for those layers is the target's own, so it reads the target's pools and writes the draft
positions' slots, which the verify forward then rewrites with the same tokens. A draft model
keeps pools of its own under the target's block tables (same block ids), so its KV is valid
exactly where the target's is: it runs on every step's rows (`follow`), prefix-cache hits
included, since a cached block was computed by a step it followed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from engine_ref.core.admission import EngineError
from engine_ref.core.attention import AttentionMetadata, kv_pool_shape
from engine_ref.core.config import ModelConfig
from engine_ref.core.model import LlamaModel
from engine_ref.core.sequence import Sequence

# (start positions, new-token counts, block tables, model config) -> metadata for its heads.
MetadataFn = Callable[[list[int], list[int], list[list[int]], ModelConfig], AttentionMetadata]


class ModelDrafter:
    """Greedy drafts from `model`'s first `num_layers` layers (None: all of them), reading
    and writing `kv_caches` (one per layer it runs). `owns_kv`: the pools are the drafter's
    own, kept in step by `follow`."""

    def __init__(
        self,
        model: LlamaModel,
        kv_caches: list[torch.Tensor],
        model_config: ModelConfig,
        metadata: MetadataFn,
        *,
        num_layers: int | None = None,
        owns_kv: bool = False,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.model_config = model_config
        self.metadata = metadata
        self.num_layers = num_layers
        self.owns_kv = owns_kv

    def next_tokens(
        self, seqs: list[Sequence], token_ids: list[int], positions: list[int]
    ) -> list[int]:
        """Each sequence's argmax token after `token_ids[i]` at `positions[i]` (one decode
        row each); writes their KV at those positions."""
        order = sorted(range(len(seqs)), key=positions.__getitem__)  # decode rows by position
        meta = self.metadata(
            [positions[i] for i in order],
            [1] * len(order),
            [seqs[i].block_table for i in order],
            self.model_config,
        )
        device = self.kv_caches[0].device
        ids = torch.tensor([token_ids[i] for i in order], dtype=torch.long, device=device)
        pos = torch.tensor([positions[i] for i in order], dtype=torch.long, device=device)
        hidden = self.model(ids, pos, meta, self.kv_caches, num_layers=self.num_layers)
        drafted = self.model.compute_logits(hidden).float().argmax(dim=-1).tolist()
        result = [0] * len(seqs)
        for row, i in enumerate(order):
            result[i] = drafted[row]
        return result

    def follow(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        starts: list[int],
        num_new_tokens: list[int],
        block_tables: list[list[int]],
    ) -> None:
        """Run the target step's rows through a draft model with its own pools, so its KV
        covers every position the target computes (a self draft shares the target's: no-op)."""
        if not self.owns_kv:
            return
        meta = self.metadata(starts, num_new_tokens, block_tables, self.model_config)
        self.model(input_ids, positions, meta, self.kv_caches)


def build_draft_model(
    name: str,
    loaded: Any,
    *,
    target_tokenizer: Any,
    target_vocab_size: int,
    num_blocks: int,
    block_size: int,
    max_positions: int,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[LlamaModel, list[torch.Tensor], ModelConfig]:
    """The draft model `name`, built from `loaded` (its loaded weights, tokenizer and
    config), with KV pools of `num_blocks` blocks; raises EngineError when it does not share
    the target's tokenizer."""
    dc = loaded.config
    if loaded.tokenizer.name != target_tokenizer.name or dc.vocab_size != target_vocab_size:
        raise EngineError(
            f"The draft model {name!r} does not share the target's tokenizer "
            f"({loaded.tokenizer.name!r}, {dc.vocab_size} tokens, against "
            f"{target_tokenizer.name!r}, {target_vocab_size}); use a draft model of the same "
            "family."
        )
    model = LlamaModel.from_state_dict(
        dc, loaded.state_dict, dtype=dtype, device=device, max_positions=max_positions
    )
    shape = kv_pool_shape(num_blocks, block_size, dc.num_key_value_heads, dc.head_dim)
    caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(dc.num_hidden_layers)]
    return model, caches, dc

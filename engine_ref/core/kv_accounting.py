"""Memory per request: the KV blocks a request held over its life, shared prefix blocks
amortised over their sharers, slots allocated but unused (fragmentation) and the step's
temporary buffers attributed by rows. Reported when the request ends (`RequestOutput.kv_memory`,
the server's `usage.kv_memory`) and, for the engine as it stands, as `/metrics` gauges.

Observed once per step, after the scheduler has allocated the step's slots and before the
forward (`KVAccounting.observe`): for each request in the batch, over the distinct blocks its
sequences' tables hold (beams share blocks),
- `blocks`: how many; the peak over the request's steps and the token-weighted mean, each step
  weighing as many tokens as the request computes in it (a 100-token prefill chunk counts 100
  times a decode row), so the mean is the blocks an average token of the request found held;
- `amortised`: each block counted as this request's references to it over the block's reference
  count (three requests sharing a prefix block hold a third of it each), token-weighted the same;
- `unused`: slots of the held blocks that hold no token once the step has written (the partly
  filled last block, speculative lookahead slots), token-weighted;
- temporary bytes: a model of the step's largest live activations, per row (`row_temp_bytes`:
  the residual stream, the normed input, q/k/v, the MLP's gate/up and product, in the activation
  dtype), float32 logits for each row that samples, and for each prefill sequence the keys and
  values gathered for attention plus its float32 scores. A request is charged its own rows; the
  peak over its steps is reported. It is an estimate from the model's shapes, not a measurement
  of the allocator: what it is good for is the order of magnitude and how it scales with rows.

Bytes are blocks times `block_bytes` (`kv_bytes_per_token` x block size: what the pool spends,
lossy formats' scales included). Requests that leave without finishing (aborted, failed) report
what they held until then.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from engine_ref.core.sequence import Sequence

LOGIT_BYTES = 4  # logits are float32 whatever the activation dtype


@dataclass(frozen=True)
class KVGeometry:
    """The shapes the accounting needs, from the model's config and the pool."""

    num_layers: int
    num_kv_heads: int
    num_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    block_size: int
    kv_bytes_per_token: int
    activation_bytes: int  # element size of the activations

    @property
    def block_bytes(self) -> int:
        return self.kv_bytes_per_token * self.block_size

    def row_temp_bytes(self) -> int:
        """Live activation bytes of one row at a layer's widest point (module doc)."""
        qkv = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        widths = 2 * self.hidden_size + qkv + 3 * self.intermediate_size
        return widths * self.activation_bytes

    def prefill_gather_bytes(self, num_queries: int, context: int) -> int:
        """Keys and values of one prefill sequence gathered for attention (one layer at a
        time) and its float32 scores, `num_queries` rows against `context` positions."""
        kv = 2 * self.num_kv_heads * context * self.head_dim * self.activation_bytes
        return kv + self.num_heads * num_queries * context * LOGIT_BYTES


@dataclass
class RequestKV:
    """One request's running sums (module doc); `report` turns them into the per-request
    record."""

    weight: int = 0
    peak_blocks: int = 0
    blocks_sum: int = 0  # sum of weight * blocks
    amortised_sum: float = 0.0
    unused_sum: int = 0
    temp_peak_bytes: int = 0
    steps: int = 0

    def report(self, geometry: KVGeometry) -> dict:
        w = self.weight or 1
        bb = geometry.block_bytes
        return {
            "block_size": geometry.block_size,
            "block_bytes": bb,
            "steps": self.steps,
            "peak_blocks": self.peak_blocks,
            "kv_peak_bytes": self.peak_blocks * bb,
            "kv_mean_bytes": round(self.blocks_sum * bb / w),
            "kv_amortised_bytes": round(self.amortised_sum * bb / w),
            "kv_unused_bytes": round(self.unused_sum * geometry.kv_bytes_per_token / w),
            "temp_peak_bytes": self.temp_peak_bytes,
        }


@dataclass
class KVAccounting:
    """Per-request sums while requests run; engine-wide gauges of the last step."""

    geometry: KVGeometry
    requests: dict[str, RequestKV] = field(default_factory=dict)
    # gauges: the last observed step
    last_temp_bytes: int = 0
    last_unused_slots: int = 0
    last_shared_blocks: int = 0

    def observe(self, items: Iterable[tuple[Sequence, int]], ref_counts: list[int]) -> None:
        """Fold in one step: `items` are the step's (sequence, new tokens), with block tables
        already covering the new tokens; `ref_counts` the block manager's."""
        g = self.geometry
        bs = g.block_size
        by_request: dict[str, list[tuple[Sequence, int]]] = {}
        for seq, n in items:
            by_request.setdefault(seq.request.request_id, []).append((seq, n))
        row_bytes = g.row_temp_bytes()
        step_temp = step_unused = 0
        shared: set[int] = set()
        for request_id, pairs in by_request.items():
            weight = unused = temp = 0
            for seq, n in pairs:
                held = seq.num_computed_tokens + n - seq.kv_evicted_tokens
                unused += len(seq.block_table) * bs - held
                weight += n
                temp += n * row_bytes + LOGIT_BYTES * g.vocab_size * _sampling_rows(seq, n)
                if n > 1:  # a prefill chunk or a verification run: the SDPA path
                    temp += g.prefill_gather_bytes(n, held)
            # The request's references to each block it holds (beams share blocks). A block
            # no other sequence holds counts whole, so only shared ones need their share:
            # amortised = blocks - sum over shared blocks of (1 - references / ref count).
            own = None if len(pairs) == 1 else Counter(b for s, _ in pairs for b in s.block_table)
            refs = pairs[0][0].block_table if own is None else own  # distinct blocks
            held_shared = [b for b in refs if ref_counts[b] > 1]
            amortised = len(refs) - sum(
                1 - (own[b] if own else 1) / ref_counts[b] for b in held_shared
            )
            shared.update(held_shared)
            acc = self.requests.setdefault(request_id, RequestKV())
            acc.steps += 1
            acc.weight += weight
            acc.peak_blocks = max(acc.peak_blocks, len(refs))
            acc.blocks_sum += weight * len(refs)
            acc.amortised_sum += weight * amortised
            acc.unused_sum += weight * unused
            acc.temp_peak_bytes = max(acc.temp_peak_bytes, temp)
            step_temp += temp
            step_unused += unused
        self.last_temp_bytes = step_temp
        self.last_unused_slots = step_unused
        self.last_shared_blocks = len(shared)

    def gauges(self) -> dict[str, int]:
        """The engine-wide figures of the last step, for `/metrics` (`vllm:kv_memory_*`)."""
        return {
            "block_bytes": self.geometry.block_bytes,
            "unused_slot_bytes": self.last_unused_slots * self.geometry.kv_bytes_per_token,
            "shared_blocks": self.last_shared_blocks,
            "temp_bytes": self.last_temp_bytes,
        }

    def annotate(self, outputs: list) -> list:
        """Set `kv_memory` on the finished ones of `outputs` (RequestOutputs), forgetting their
        sums; a request never scheduled has None."""
        for output in outputs:
            if output.finished:
                acc = self.requests.pop(output.request_id, None)
                output.kv_memory = None if acc is None else acc.report(self.geometry)
        return outputs


def _sampling_rows(seq: Sequence, n: int) -> int:
    """Rows of this step that produce logits: a chunk computing known tokens (a prompt, or a
    preempted sequence's recompute) samples only when it reaches the last one; rows beyond the
    known tokens (a decode row, speculative drafts being verified) each sample."""
    known = len(seq.token_ids) - seq.num_computed_tokens
    if n <= known:
        return int(n == known)
    return n - known + 1

"""Request and sequence state: raw facts, derived values as properties, lifecycle as an Enum."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from engine_ref.core.beam_search import BeamHypothesis
from engine_ref.core.detokenizer import IncrementalDetokenizer
from engine_ref.core.engine_config import SamplingParams
from engine_ref.core.grammar import GrammarMatcher


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One sampled continuation. `token_ids` holds the prompt then the outputs;
    `num_computed_tokens` of them have KV in `block_table`'s blocks."""

    seq_id: int
    request: Request
    index: int
    token_ids: list[int]
    num_prompt_tokens: int
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None = None
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # of the registered full blocks
    # Tokens whose KV was evicted after the sink blocks (`core.kv_eviction`; a multiple of the
    # block size): position p is at table index p // bs - kv_evicted_tokens // bs past the sinks.
    kv_evicted_tokens: int = 0
    finish_reason: str | None = None
    logprobs: list[dict[int, float]] | None = None
    num_preemptions: int = 0
    num_emitted_chars: int = 0  # of detokenizer.text already returned to the caller
    # Speculative decoding: the draft slots this step reserves (the scheduler may cut them),
    # the drafted tokens (verified after the last token), the moving acceptance rate of its
    # verify steps, and steps left before it drafts again.
    num_lookahead_tokens: int = 0
    draft_token_ids: list[int] = field(default_factory=list)
    draft_parents: list[int | None] | None = None  # a token tree's (see DraftTree); None: chain
    spec_acceptance: float = 1.0
    spec_pause_steps: int = 0
    # Guided decoding: where the committed output tokens are in the request's grammar.
    grammar: GrammarMatcher | None = None
    # Beam search: the beam's cumulative log-probability, and its best continuations
    # (token, log-probability) from its latest logits row, kept until every live beam of the
    # request has its own (then the request takes its beam step).
    beam_score: float = 0.0
    beam_candidates: list[tuple[int, float]] | None = None
    # Scheduling (`engine_ref.core.policy`): the scheduler step it last entered the waiting
    # queue at, the priority levels it has earned by waiting (kept while it runs), and how many
    # later arrivals the `affinity` policy admitted ahead of it.
    waiting_since_step: int = 0
    priority_credit: int = 0
    num_bypassed: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens


@dataclass(eq=False)
class Request:
    """A request: its prompt, sampling parameters and the n sequences sampling from it.
    Before its prefill completes, an n > 1 request has one sequence; it forks at the first
    sampled token so the children share the prompt's blocks. Only requests with equal
    `cache_salt` share prefix-cache blocks."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    arrival_index: int
    sequences: list[Sequence] = field(default_factory=list)
    num_cached_tokens: int = 0
    is_forked: bool = False
    cache_salt: str | None = None
    tenant: str = ""  # whose share the `fair` policy charges its tokens to
    deadline_s: float | None = None  # on the engine's clock; None: no deadline
    # The most tokens one of its sequences had evicted (`core.kv_eviction`); 0: exact KV.
    kv_evicted_tokens: int = 0
    # Beam search: the finished hypotheses so far, whether the search is over, and the next
    # sequence index a forked beam takes.
    beam_finished: list[BeamHypothesis] = field(default_factory=list)
    beam_done: bool = False
    next_index: int = 1

    @property
    def is_finished(self) -> bool:
        if self.params.use_beam_search:
            return self.beam_done
        return all(s.is_finished for s in self.sequences) and (self.is_forked or self.params.n == 1)

    @property
    def needs_fork(self) -> bool:
        return self.params.n > 1 and not self.is_forked and not self.params.use_beam_search

"""Materialise a spec plus overrides into a `Workload` (table + manifest)."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from workloads import arrivals as arr
from workloads.assemble import FULL_CHECK_TOKENS, PromptCheck, plain_prompts, prefixed_prompts
from workloads.blocks import MOONCAKE_BLOCK_TOKENS, BlockSynthesizer, block_reuse_from_ids
from workloads.lengths import Fixed, LengthDist, Uniform, length_from_spec, uniform_bounds
from workloads.loaders import ShareGPTRules, load_sharegpt, load_trace
from workloads.options import WorkloadOptions
from workloads.prompts import Prompt, PromptSynthesizer, verify_prompts
from workloads.schema import (
    REQUEST_SCHEMA,
    SHA256_BATCHED,
    SHA256_ONE_BATCH,
    Workload,
    WorkloadError,
    table_sha256,
)
from workloads.sessions import SessionColumns, session_rows
from workloads.spec import WorkloadSpec
from workloads.store import WorkloadWriter

BLOCK_CHUNK_ROWS = 256  # Mooncake rows built, verified and written at a time

FORMAT_VERSION = 2  # 2: Mooncake blocks tagged by id, streamed builds


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """Short sha256 over the ids of a probe text: tells apart tokenizers sharing a name."""
    probe = "The quick brown fox, 1234 tokens; naïve café — déjà vu!\n\tdef f(x): return x"
    ids = list(tokenizer.encode(probe))
    return hashlib.sha256(repr(ids).encode()).hexdigest()[:16]


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "inf" if value > 0 else ("-inf" if value < 0 else "nan")
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return _json_safe(float(value))
    return value


def _override_length(dist: LengthDist, value: int | None, ratio: float | None) -> LengthDist:
    if value is not None:
        if ratio:
            low, high = uniform_bounds(value, ratio)
            return Uniform(low=low, high=high)
        return Fixed(value=value)
    if ratio is not None:
        if not isinstance(dist, Fixed):
            raise WorkloadError(
                "range_ratio applies to fixed lengths; also give input_len/output_len."
            )
        low, high = uniform_bounds(dist.value, ratio)
        return Uniform(low=low, high=high, min=dist.min, max=dist.max)
    return dist


def _arrival_process(
    spec: dict[str, Any], opts: WorkloadOptions, origin: str = "spec"
) -> arr.ArrivalProcess | None:
    """The spec's process with overrides applied; None means trace timestamps."""
    raw = dict(spec.get("arrivals", {"process": "all_at_once"}))
    if opts.concurrency is not None:
        if opts.request_rate is not None or opts.burstiness is not None:
            raise WorkloadError(
                "Give either concurrency (closed loop) or request_rate/burstiness, not both."
            )
        return arr.ClosedLoop(concurrency=opts.concurrency)
    if opts.request_rate is not None and math.isinf(opts.request_rate):
        if opts.burstiness is not None:
            raise WorkloadError("burstiness needs a finite request_rate.")
        return arr.AllAtOnce()
    kind = raw["process"]
    spec_process = (
        None if kind == "trace" else arr.arrivals_from_spec(raw, where=f"{origin}: arrivals")
    )
    if opts.request_rate is None and opts.burstiness is None:
        return spec_process
    rate = opts.request_rate if opts.request_rate is not None else raw.get("rate")
    if rate is None:
        raise WorkloadError(
            f"burstiness needs a request rate; the {kind!r} arrivals have none, so give request_rate."
        )
    if opts.burstiness is not None:
        shape = opts.burstiness
    elif kind == "gamma":
        shape = float(raw["burstiness"])
    elif kind == "constant":
        shape = math.inf
    else:
        shape = 1.0
    return arr.GammaProcess(
        rate=float(rate), burstiness=shape, normalize_total=bool(raw.get("normalize_total", True))
    )


def _interleave(weights: list[float], n: int, mode: str, rng: np.random.Generator) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64) / sum(weights)
    if mode == "random":
        return rng.choice(len(w), size=n, p=w)
    counts = np.zeros(len(w))
    out = np.empty(n, dtype=np.int64)
    for i in range(n):  # smooth weighted round robin: exact proportions, evenly spread
        k = int(np.argmax(w * (i + 1) - counts))
        out[i] = k
        counts[k] += 1
    return out


class _Builder:
    def __init__(
        self,
        spec: WorkloadSpec,
        opts: WorkloadOptions,
        tokenizer: Any,
        synth: PromptSynthesizer | None,
    ):
        self.spec, self.opts, self.tok = spec, opts, tokenizer
        self.data = spec.data
        self.source = dict(self.data.get("source", {"kind": "synthetic"}))
        self.seed = opts.seed if opts.seed is not None else int(self.data.get("seed", 0))
        streams = np.random.SeedSequence(self.seed).spawn(4)
        self.rng_len, self.rng_arr, self.rng_prompt, self.rng_mix = (
            np.random.default_rng(s) for s in streams
        )
        self._synth = synth
        self.check = PromptCheck()
        self.info: dict[str, Any] = {}
        self.synthetic = True
        self.source_text = ""
        self.hashes: list[list[int]] | None = None

    @property
    def synth(self) -> PromptSynthesizer:
        if self._synth is None:
            self._synth = PromptSynthesizer(self.tok)
        return self._synth

    def dist(self, value: Any, where: str) -> LengthDist:
        return length_from_spec(
            value, base_dir=self.spec.base_dir, where=f"{self.spec.origin}: {where}"
        )

    def path(self, value: str | None) -> Path | None:
        if value is None:
            return None
        p = Path(value)
        return (
            p
            if p.is_absolute() or self.spec.base_dir is None or p.exists()
            else self.spec.base_dir / p
        )

    # -- lengths by source kind -----------------------------------------------------------

    def synthetic_lengths(
        self, n: int, input_spec: Any, output_spec: Any, where: str
    ) -> tuple[np.ndarray, np.ndarray]:
        d_in = _override_length(
            self.dist(input_spec, f"{where}.input"), self.opts.input_len, self.opts.range_ratio
        )
        d_out = _override_length(
            self.dist(output_spec, f"{where}.output"), self.opts.output_len, self.opts.range_ratio
        )
        self.info["input_lengths"], self.info["output_lengths"] = d_in.describe(), d_out.describe()
        return d_in.sample(n, self.rng_len), d_out.sample(n, self.rng_len)

    def mix_lengths(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        comps = self.source["components"]
        which = _interleave(
            [float(c.get("weight", 1)) for c in comps],
            n,
            self.source.get("interleave", "alternate"),
            self.rng_mix,
        )
        ins, outs = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
        described = []
        for k, comp in enumerate(comps):
            mask = which == k
            i, o = self.synthetic_lengths(
                int(mask.sum()), comp["input"], comp["output"], f"source.components[{k}]"
            )
            ins[mask], outs[mask] = i, o
            described.append(
                {
                    "name": comp.get("name", f"component{k}"),
                    "weight": comp.get("weight", 1),
                    "input": self.info.pop("input_lengths"),
                    "output": self.info.pop("output_lengths"),
                }
            )
        self.info["components"] = described
        return ins, outs, which

    # -- main -----------------------------------------------------------------------------

    def build(self) -> _Rows:
        opts, data, kind = self.opts, self.data, self.source["kind"]
        if opts.dataset_path is not None and kind not in ("sharegpt", "trace", "sessions"):
            raise WorkloadError(f"Workload {self.spec.name!r} reads no dataset; drop dataset_path.")
        duration_s = opts.duration_s if opts.duration_s is not None else data.get("duration_s")
        if opts.num_requests is not None:
            n_spec = opts.num_requests
        elif opts.duration_s is not None:
            n_spec = None  # the duration decides
        elif duration_s is not None:
            n_spec = data.get("num_requests")  # a spec with a duration caps only if it says so
        else:  # a trace replays all its rows unless told otherwise
            n_spec = data.get("num_requests", None if kind == "trace" else 100)
        proc = _arrival_process(data, opts, self.spec.origin)
        prompts: list[Prompt] | None = None
        groups_col: list[str | None] | None = None
        times: np.ndarray | None
        if kind == "trace":
            times, ins, outs, prompts, groups_col = self.trace(proc, n_spec, duration_s)
        else:
            if proc is None:
                raise WorkloadError("trace arrivals need a trace source.")
            times = proc.times(n_spec, duration_s, self.rng_arr)
            n = len(times) if times is not None else int(n_spec or data.get("num_requests") or 100)
            if n == 0:
                raise WorkloadError(
                    "The arrival process produced no requests; raise duration_s or the rate."
                )
            if kind == "synthetic":
                ins, outs = self.synthetic_lengths(
                    n, self.source["input"], self.source["output"], "source"
                )
            elif kind == "mix":
                ins, outs, which = self.mix_lengths(n)
                names = [
                    c.get("name", f"component{k}") for k, c in enumerate(self.source["components"])
                ]
                self.info["component_counts"] = {
                    names[k]: int((which == k).sum()) for k in range(len(names))
                }
            elif kind == "sessions":
                ins, outs, prompts, sessions = session_rows(self, n)
                self.info["arrivals"] = proc.describe() | {"of": "sessions"}
                return _Rows(
                    sessions.row_times(times),
                    ins,
                    outs,
                    iter([(prompts, None)]),
                    proc,
                    duration_s,
                    False,
                    sessions,
                )
            else:
                ins, outs, prompts = self.sharegpt(n)
        self.info["arrivals"] = proc.describe() if proc is not None else self.info.get("arrivals")
        if self.hashes is not None:
            return _Rows(times, ins, outs, self.block_batches(ins), proc, duration_s, True)
        if prompts is None:
            prompts, groups_col, ins = self.make_prompts(ins)
        return _Rows(times, ins, outs, iter([(prompts, groups_col)]), proc, duration_s, False)

    def block_batches(self, ins: np.ndarray) -> Iterator[tuple[list[Prompt], list[str]]]:
        """Mooncake prompts, `BLOCK_CHUNK_ROWS` at a time (see `workloads.blocks`), verified
        as they go: all of them up to `FULL_CHECK_TOKENS` prompt tokens, else a seeded sample
        of each chunk holding its share of `FULL_CHECK_TOKENS` (the cost of checking is bounded
        by tokens, not prompts), and every later prompt once a sampled one fails."""
        hashes = self.hashes
        distinct = len({h for ids in hashes for h in ids})
        blocks = BlockSynthesizer(self.synth, distinct)
        total = int(ins.sum())
        self.check.mode = "sample" if total > FULL_CHECK_TOKENS else "all"
        share = min(1.0, FULL_CHECK_TOKENS / max(total, 1))
        for start in range(0, len(hashes), BLOCK_CHUNK_ROWS):
            part = hashes[start : start + BLOCK_CHUNK_ROWS]
            prompts = blocks.prompts(ins[start : start + len(part)], part, self.rng_prompt)
            everything = list(range(len(prompts)))
            idx = everything
            if self.check.mode == "sample":
                size = min(len(prompts), math.ceil(len(prompts) * share))
                idx = sorted(
                    self.rng_prompt.choice(len(prompts), size=size, replace=False).tolist()
                )
            bad = self._verify_blocks(prompts, idx)
            if bad and len(idx) < len(prompts):
                self.check.mode = "all (a sampled prompt failed)"
                bad += self._verify_blocks(prompts, sorted(set(everything) - set(idx)))
            self.check.mismatched += len(bad)
            yield prompts, [f"hash-{ids[0]}" for ids in part]
        if self.check.mismatched:
            self.check.notes.append(
                f"{self.check.mismatched} block prompt(s) do not re-tokenise to their ids; their ids are kept."
            )
        self.info["blocks"] = {
            "block_tokens": MOONCAKE_BLOCK_TOKENS,
            "distinct_hash_ids": distinct,
            "distinct_blocks": blocks.num_blocks,
            "tag_words": blocks.tag_len,
            "infinite_cache_block_hits": block_reuse_from_ids(hashes, ins.tolist()),
            "note": "distinct hash ids give distinct token blocks (a tag of one-token words "
            "spelling the id's index starts every block)",
        }

    def make_prompts(
        self, ins: np.ndarray
    ) -> tuple[list[Prompt], list[str | None] | None, np.ndarray]:
        prefix = self.data.get("prefix")
        if prefix is None:
            return plain_prompts(self.synth, ins, self.rng_prompt, self.check), None, ins
        n, g, plen = len(ins), int(prefix["groups"]), int(prefix["prefix_len"])
        if prefix.get("assign", "round_robin") == "random":
            groups = self.rng_mix.integers(0, g, size=n)
        else:
            groups = np.arange(n) % g
        prompts = prefixed_prompts(self.synth, ins, groups, plen, self.rng_prompt, self.check)
        self.info["prefix"] = {
            "groups": g,
            "prefix_len": plen,
            "assign": prefix.get("assign", "round_robin"),
            "note": "input length = prefix_len + sampled suffix length",
        }
        return prompts, [f"group-{k}" for k in groups.tolist()], ins + plen

    def sharegpt(self, n: int) -> tuple[np.ndarray, np.ndarray, list[Prompt] | None]:
        path = self.path(self.opts.dataset_path or self.source.get("path"))
        rules = ShareGPTRules(
            **{
                k: self.source[k]
                for k in (
                    "min_prompt_tokens",
                    "max_prompt_tokens",
                    "min_output_tokens",
                    "max_total_tokens",
                    "shuffle",
                )
                if k in self.source
            }
        )
        if path is None:
            fb = self.source.get("fallback")
            if fb is None:
                raise WorkloadError(
                    f"Workload {self.spec.name!r} needs dataset_path (a ShareGPT JSON file)."
                )
            ins, outs = self.synthetic_lengths(n, fb["input"], fb["output"], "source.fallback")
            self.source_text = fb.get("description", "synthetic lengths standing in for ShareGPT")
            self.info["sharegpt_file"] = None
            return ins, outs, None
        if self.opts.input_len is not None:
            raise WorkloadError(
                "ShareGPT prompts keep their own lengths; drop input_len (output_len may be set)."
            )
        sample = load_sharegpt(
            path,
            tokenizer=self.tok,
            num_requests=n,
            seed=self.seed,
            rules=rules,
            output_len=self.opts.output_len,
            skip_malformed=bool(self.source.get("skip_malformed", False)),
        )
        self.synthetic = False
        self.source_text = f"ShareGPT conversations from {path} (vLLM sampling rules)"
        self.info["sharegpt_file"] = {
            "path": str(path),
            "rules": rules.__dict__,
            "considered": sample.considered,
            "filtered_out": sample.filtered_out,
            "oversampled": sample.oversampled,
            "skipped_rows": sample.skipped_rows,
        }
        prompts = [
            Prompt(t, np.asarray(ids, dtype=np.int64))
            for t, ids in zip(sample.prompts, sample.prompt_token_ids, strict=True)
        ]
        ins = np.asarray([len(p.token_ids) for p in prompts], dtype=np.int64)
        return ins, np.asarray(sample.output_tokens, dtype=np.int64), prompts

    def trace(self, proc, n_spec, duration_s):
        path = self.path(self.opts.dataset_path or self.source.get("path"))
        if path is None:
            raise WorkloadError(
                f"Workload {self.spec.name!r} needs dataset_path (a {self.source['format']} trace file)."
            )
        if self.opts.input_len is not None:
            raise WorkloadError(
                "Trace requests keep their recorded prompt lengths; drop input_len."
            )
        rec = load_trace(
            self.source["format"],
            path,
            skip_malformed=bool(self.source.get("skip_malformed", False)),
            model=self.source.get("model"),
            log_type=self.source.get("log_type"),
        )
        if len(rec) == 0:
            raise WorkloadError(f"Trace {path} holds no usable request.")
        self.synthetic = False
        self.source_text = (
            f"{self.source['format']} trace {path} (recorded token counts; prompts synthesised)"
        )
        self.info["trace"] = {
            "format": self.source["format"],
            "path": str(path),
            "rows": len(rec),
            "skipped_rows": rec.skipped_rows,
            "dropped_failed": rec.dropped_failed,
            "filtered_rows": rec.filtered_rows,
        }
        if proc is None:  # recorded timestamps, rows in time order
            a = dict(self.data["arrivals"])
            tt = arr.TraceTimes(
                timestamps_s=tuple(rec.timestamps_s.tolist()),
                speedup=float(a.get("speedup", 1.0)),
                jitter_s=float(a.get("jitter_s", 0.0)),
                source=str(path),
            )
            self.info["arrivals"] = tt.describe()
            all_times = tt.times(None, None, self.rng_arr)
            order = np.argsort(all_times, kind="stable")
            keep = order
            if duration_s is not None:
                keep = keep[all_times[keep] <= duration_s]
            if n_spec is not None:
                keep = keep[:n_spec]
            times = all_times[keep]
        else:
            n = n_spec if n_spec is not None else len(rec)
            times = proc.times(n, duration_s, self.rng_arr)
            count = len(times) if times is not None else n
            if self.source.get("sample", "sequential") == "bootstrap":
                keep = self.rng_len.integers(0, len(rec), size=count)
            else:
                keep = np.arange(count) % len(rec)
        ins = rec.input_tokens[keep].astype(np.int64)
        outs = rec.output_tokens[keep].astype(np.int64)
        if self.opts.output_len is not None:
            outs = np.full(len(keep), self.opts.output_len, dtype=np.int64)
        if rec.hash_ids is not None:
            self.hashes = [rec.hash_ids[int(i)] for i in keep]
        return times, ins, outs, None, None

    def _verify_blocks(self, prompts: list[Prompt], idx: list[int]) -> list[int]:
        bad: list[int] = []
        for at in range(0, len(idx), 32):  # bounded: an encoding costs ~300 bytes a token
            bad += verify_prompts(self.tok, prompts, indices=idx[at : at + 32])
        self.check.checked += len(idx)
        return bad

    def batch(self, rows: _Rows, start: int, prompts: list[Prompt], groups) -> pa.RecordBatch:
        """Rows `start .. start + len(prompts)` of the table."""
        data, opts = self.data, self.opts
        n = len(prompts)
        stop = start + n
        ignore_eos = (
            opts.ignore_eos if opts.ignore_eos is not None else bool(data.get("ignore_eos", True))
        )
        width = max(6, len(str(len(rows.ins) - 1)))
        lengths = [len(p.token_ids) for p in prompts]
        offsets = np.zeros(n + 1, dtype=np.int32)
        np.cumsum(lengths, out=offsets[1:])
        flat = (
            np.concatenate([p.token_ids for p in prompts]).astype(np.int32)
            if n
            else np.empty(0, dtype=np.int32)
        )
        ids_col = pa.ListArray.from_arrays(
            pa.array(offsets, pa.int32()), pa.array(flat, pa.int32())
        )
        temperature, top_p = data.get("temperature"), data.get("top_p")
        times = rows.times
        columns = {
            "request_id": pa.array([f"req-{i:0{width}d}" for i in range(start, stop)], pa.string()),
            "arrival_s": pa.nulls(n, pa.float64()) if times is None else _floats(times[start:stop]),
            "prompt": pa.array([p.text for p in prompts], pa.string()),
            "prompt_token_ids": ids_col,
            "input_tokens": pa.array(np.asarray(lengths, dtype=np.int32), pa.int32()),
            "max_output_tokens": pa.array(
                np.maximum(np.asarray(rows.outs[start:stop]), 1).astype(np.int32), pa.int32()
            ),
            "ignore_eos": pa.array(np.full(n, ignore_eos), pa.bool_()),
            "temperature": pa.array([temperature] * n, pa.float32()),
            "top_p": pa.array([top_p] * n, pa.float32()),
            "seed": pa.nulls(n, pa.int64()),
            "prefix_group": pa.array(groups if groups is not None else [None] * n, pa.string()),
            **self.session_columns(rows.sessions, start, stop),
            "priority": pa.nulls(n, pa.int32()),
            "deadline_s": pa.nulls(n, pa.float64()),
        }
        return pa.RecordBatch.from_arrays(list(columns.values()), schema=REQUEST_SCHEMA)

    @staticmethod
    def session_columns(sessions: SessionColumns | None, start: int, stop: int) -> dict:
        n = stop - start
        if sessions is None:
            return {
                "session_id": pa.nulls(n, pa.string()),
                "turn_index": pa.nulls(n, pa.int32()),
                "think_s": pa.nulls(n, pa.float64()),
            }
        return {
            "session_id": pa.array(sessions.session_id[start:stop], pa.string()),
            "turn_index": pa.array(sessions.turn_index[start:stop], pa.int32()),
            "think_s": _floats(sessions.think_s[start:stop]),
        }

    def batches(self, rows: _Rows) -> Iterator[pa.RecordBatch]:
        start = 0
        for prompts, groups in rows.prompts:
            yield self.batch(rows, start, prompts, groups)
            start += len(prompts)

    def manifest(self, rows: _Rows, num_requests: int, sha256: str) -> dict[str, Any]:
        data, opts = self.data, self.opts
        endpoint = opts.endpoint or data.get("endpoint", "completions")
        manifest = {
            "format_version": FORMAT_VERSION,
            "generator": f"workloads.{self.source['kind']}",
            "name": self.spec.name,
            "origin": self.spec.origin,
            "description": self.spec.description,
            "seed": self.seed,
            "tokenizer": getattr(self.tok, "name", type(self.tok).__name__),
            "tokenizer_fingerprint": tokenizer_fingerprint(self.tok),
            "synthetic": self.synthetic,
            "source": self.source_text
            or "synthetic: lengths from distributions, prompts from the bundled corpus",
            "endpoint": endpoint,
            "prompt_format": _prompt_format(endpoint, rows.sessions is not None),
            "num_requests": num_requests,
            "num_sessions": len(rows.sessions.first_row) if rows.sessions is not None else None,
            "closed_loop_concurrency": rows.closed,
            "duration_s": rows.duration_s,
            "constraint": data.get("constraint"),
            "parameters": {
                "spec": self.data,
                "overrides": opts.overrides(),
                "effective": self.info,
            },
            "prompt_check": self.check.as_dict() | {"notes": self.check.notes},
            "sha256": sha256,
            "sha256_of": SHA256_BATCHED if rows.streamed else SHA256_ONE_BATCH,
        }
        return _json_safe(manifest)


def _floats(values: np.ndarray) -> pa.Array:
    """float64 with NaN as null, the null slots zero (as a parquet round trip leaves them, so
    the table's sha256 survives one)."""
    values = np.asarray(values, dtype=np.float64)
    missing = np.isnan(values)
    return pa.array(np.where(missing, 0.0, values), pa.float64(), mask=missing)


def _prompt_format(endpoint: str, sessions: bool) -> str:
    if sessions:
        return (
            "sessions: prompt is the turn's new user message; the harness sends it after the "
            "session's earlier turns and the engine's answers, and input_tokens counts it alone"
        )
    if endpoint == "chat":
        return "chat: prompt is the single user message; input_tokens counts its content, not the chat template"
    return "completions: prompt text as sent"


@dataclass
class _Rows:
    """What a build decided before its prompts exist: times, lengths, and the prompts (with
    their prefix groups) as an iterator of chunks; `streamed` builds hash in batches."""

    times: np.ndarray | None
    ins: np.ndarray
    outs: np.ndarray
    prompts: Iterator[tuple[list[Prompt], list[str | None] | None]]
    proc: arr.ArrivalProcess | None
    duration_s: float | None
    streamed: bool
    sessions: SessionColumns | None = None

    @property
    def closed(self) -> int | None:
        return self.proc.concurrency if isinstance(self.proc, arr.ClosedLoop) else None


def build_workload(
    spec: WorkloadSpec,
    options: WorkloadOptions,
    tokenizer: Any,
    *,
    synthesizer: PromptSynthesizer | None = None,
) -> Workload:
    """Materialise `spec` with `options` for `tokenizer` in memory (see `resolve_workload` for
    caching, `build_workload_file` for bounded memory)."""
    builder = _Builder(spec, options, tokenizer, synthesizer)
    rows = builder.build()
    table = pa.Table.from_batches(list(builder.batches(rows)), schema=REQUEST_SCHEMA)
    of = SHA256_BATCHED if rows.streamed else SHA256_ONE_BATCH
    manifest = builder.manifest(rows, table.num_rows, table_sha256(table, of=of))
    return Workload(table=table, manifest=manifest, closed_loop_concurrency=rows.closed)


def build_workload_file(
    spec: WorkloadSpec,
    options: WorkloadOptions,
    tokenizer: Any,
    path: Path,
    *,
    synthesizer: PromptSynthesizer | None = None,
) -> dict[str, Any]:
    """Materialise `spec` straight into the parquet file `path`, one chunk of rows at a time
    (bounded memory for trace-scale Mooncake builds); returns the manifest."""
    builder = _Builder(spec, options, tokenizer, synthesizer)
    rows = builder.build()
    writer = WorkloadWriter(path, hash_rows=rows.streamed)
    try:
        if rows.streamed:
            for batch in builder.batches(rows):
                writer.write(batch)
            manifest = builder.manifest(rows, writer.num_rows, writer.sha256())
        else:
            table = pa.Table.from_batches(list(builder.batches(rows)), schema=REQUEST_SCHEMA)
            writer.write(table)
            manifest = builder.manifest(rows, table.num_rows, table_sha256(table))
    except BaseException:
        writer.abort()
        raise
    writer.close(manifest)
    return manifest

"""Shared by the scheduling-policy and overload tests: a tiny-random engine with one knob per
test, a clock the test moves, and the order in which requests finish."""

from __future__ import annotations

import json

from engine_ref import EngineConfig, LLMEngine, SamplingParams
from engine_ref.core.step_meter import StepRates

PARAMS = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)


class ManualClock:
    """Engine time in seconds that moves only when the test says so."""

    def __init__(self, now_s: float = 0.0) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s


class StepClock:
    """Engine time that moves `step_s` per `engine.step()` call, after the call: a step's
    deadline checks see the time before it, and its measured duration is 0 (so injected rates
    stay as they are)."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.num_steps = 0

    def __call__(self) -> float:
        return self.num_steps * self.step_s

    def drive(self, engine: LLMEngine) -> LLMEngine:
        step = engine.step

        def counted_step():
            try:
                return step()
            finally:
                self.num_steps += 1

        engine.step = counted_step
        return engine


def make(
    tiny_model, policy: str = "fcfs", *, clock=None, rates: StepRates | None = None, **options
):
    config = EngineConfig(model="tiny-random", dtype="float32", device="cpu", num_threads=1,
                          scheduling_policy=policy, **{"num_blocks": 64, "max_num_seqs": 1,
                                                      **options})  # fmt: skip
    kwargs = {} if clock is None else {"clock": clock}
    return LLMEngine(config, loaded=tiny_model, rates=rates, **kwargs)


def prompt(n: int, start: int) -> list[int]:
    """`n` distinct token ids from `start` (no prefix shared with another start)."""
    return [(start + i) % 500 + 10 for i in range(n)]


def finish_order(engine: LLMEngine, steps: int | None = None) -> list[str]:
    done = []
    while engine.has_unfinished() and (steps is None or steps > 0):
        done += [out.request_id for out in engine.step() if out.finished]
        steps = None if steps is None else steps - 1
    return done


def post(path: str, body: dict, headers: dict[str, str] | None = None) -> bytes:
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    return (head + f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode() + data

"""Which tokenizer counts a run's tokens: the one of the model under test.

The reference engine's own model; for an external target `--tokenizer` (a Hugging Face
directory or its `tokenizer.json`, a GGUF file, or a reference model name), else what the
managed engine serves (the exported directory, the GGUF file), else `--model` when it names a
reference model, else (`choose_for_run`, which may ask the target) the model a reference
server's `/info` names. When none of these says, the default model's tokenizer is used and
the run says so: its prompt lengths and token counts may be off.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from harness.errors import HarnessError
from harness.targets.config import TargetConfig
from harness.targets.engines import DEFAULT_MODEL, LaunchPlan
from harness.targets.probe import target_info
from harness.targets.spec import REF


@dataclass(frozen=True)
class TokenizerChoice:
    """`source` is what `load_tokenizer` is given; `how` says why it was chosen; `warning` is a
    sentence when the target's tokenizer is not known."""

    source: str
    how: str
    warning: str | None = None

    def to_dict(self) -> dict:
        return {"source": self.source, "how": self.how, "known": self.warning is None}


def names_a_model(text: str) -> bool:
    """`text` is a reference model name, an existing GGUF file or a model directory."""
    from engine_ref.loading.model_files import known_model_names

    path = Path(text).expanduser()
    return text in known_model_names() or path.is_dir() or path.suffix == ".gguf" and path.is_file()


def choose_tokenizer(target: TargetConfig, plan: LaunchPlan | None = None) -> TokenizerChoice:
    """The tokenizer of the model under test (see the module docstring)."""
    if target.tokenizer:
        return TokenizerChoice(target.tokenizer, "--tokenizer")
    if plan is not None:
        return TokenizerChoice(plan.tokenizer_source, f"served by the managed {plan.spec.name}")
    if target.spec.kind == REF:
        return TokenizerChoice(target.model or DEFAULT_MODEL, "the reference engine's model")
    if target.model and names_a_model(target.model):
        return TokenizerChoice(target.model, "--model names a reference model")
    return TokenizerChoice(
        DEFAULT_MODEL,
        "default (the target's tokenizer is unknown)",
        warning=(
            f"The target's tokenizer is not known, so prompts are built and tokens counted with "
            f"{DEFAULT_MODEL}'s; pass --tokenizer (an HF directory, tokenizer.json, GGUF file or "
            "reference model name) for figures in the target's tokens."
        ),
    )


def choose_for_run(target: TargetConfig, plan: LaunchPlan | None = None) -> TokenizerChoice:
    """`choose_tokenizer`, and for a URL target it leaves unplaced, what the target says it
    serves: a reference server's `/info` names its model (one GET; an unreachable target or
    another engine leaves the default and its warning)."""
    choice = choose_tokenizer(target, plan)
    if choice.warning is None:  # placed (a managed engine's plan always is)
        return choice
    if not target.spec.is_url:
        return choice
    info = target_info(target.spec.url, target.api_key, target.headers)
    model = info.get("model") if info.get("engine") == "engine_ref" else None
    if isinstance(model, str) and names_a_model(model):
        return TokenizerChoice(model, "the reference server's /info names its model")
    return choice


def load_chosen(choice: TokenizerChoice):
    """Load `choice.source`; a `tokenizer.json` file is read with the files beside it."""
    from engine_ref.loading import load_tokenizer

    path = Path(choice.source).expanduser()
    try:
        if path.is_file() and path.suffix == ".json":
            from engine_ref.loading.hf_loader import load_hf_tokenizer

            return load_hf_tokenizer(path.parent, name=path.parent.name)
        return load_tokenizer(choice.source)
    except Exception as exc:  # the loader's own errors are one sentence; keep them so
        raise HarnessError(f"cannot load the tokenizer {choice.source!r}: {exc}") from exc


def chat_overhead_tokens(tokenizer) -> int:
    """Tokens the chat template adds around one user message (0 without a template)."""
    probe = "Hello there, how are you today?"
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": probe}])
    except (ValueError, AttributeError):
        return 0
    return max(0, len(tokenizer.encode(text)) - len(tokenizer.encode(probe)))

"""`TargetSpec`: what a run drives, parsed once from `--target` and `--url`.

`--target` names `ref` (the reference engine, started on loopback), an engine of
`harness.targets.engines.ENGINES` (started from its command template), or `url:http://...` (a
server already running); `--url` names a running server too and wins over `--target`.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.errors import HarnessError
from harness.targets.engines import ENGINES

REF = "ref"
URL = "url"
URL_PREFIX = "url:"
TARGET_NAMES = (REF, *ENGINES)


def normalise_base_url(url: str) -> str:
    """The OpenAI base URL for `url`: `http://host:port` (vLLM's `--base-url` form) gets `/v1`.

    A URL with any other path is kept as given (some gateways mount the API elsewhere); a
    trailing slash is dropped. Raises `HarnessError` for a URL that is not http(s)."""
    if not url.startswith(("http://", "https://")):
        raise HarnessError(f"--url must start with http:// or https://, got {url!r}.")
    url = url.rstrip("/")
    _, _, rest = url.partition("://")
    if "/" not in rest:
        return f"{url}/v1"
    return url


@dataclass(frozen=True)
class TargetSpec:
    """What a run drives. `kind` is `ref`, an engine name (`vllm`, `llamacpp`) or `url`; `url`
    is the normalised OpenAI base URL of a `url` target (None for the others).

    `text` is the `--target` value as given (default `ref`) and `url_flag` says the URL came
    from `--url`: `flags()` gives both back as the manifest records them."""

    kind: str = REF
    url: str | None = None
    text: str = REF
    url_flag: bool = False

    @classmethod
    def parse(cls, target: str | None = None, url: str | None = None) -> TargetSpec:
        """The spec of `--target TEXT` and `--url URL` (either may be None). `--target` is
        checked even beside `--url`, and `--url` wins when both are given. Raises
        `HarnessError` for an unknown target name or a URL that is not http(s)."""
        text = REF if target is None else target
        kind, target_url = _parse_text(text)
        if url is not None:
            return cls(URL, normalise_base_url(url), text, url_flag=True)
        return cls(kind, target_url, text)

    @property
    def is_url(self) -> bool:
        """A server already running at `url`: the harness starts nothing."""
        return self.kind == URL

    @property
    def engine(self):
        """The `EngineSpec` of a managed external engine; None for `ref` and URL targets."""
        return ENGINES.get(self.kind)

    def flags(self) -> dict:
        """`{"url": ..., "target": ...}` as `--url` and `--target` gave them (the manifest's)."""
        return {"url": self.url if self.url_flag else None, "target": self.text}


def _parse_text(text: str) -> tuple[str, str | None]:
    """`(kind, url)` of a `--target` value: `ref`, an engine name, or `url:http://...`."""
    if text.startswith(URL_PREFIX):
        url = text[len(URL_PREFIX) :]
        if not url.startswith(("http://", "https://")):
            raise HarnessError(f"--target {text!r}: the URL must start with http:// or https://.")
        return URL, normalise_base_url(url)
    if text in TARGET_NAMES:
        return text, None
    raise HarnessError(
        f"unknown --target {text!r}; use one of {', '.join(TARGET_NAMES)} or url:http://HOST:PORT/v1."
    )

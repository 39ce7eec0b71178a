"""Reusable byte buffers for KV handoffs (`kv_handoff`, `cluster.kv_link`).

A 2,048-token SmolLM2 handoff is 47 MB. Copied into a fresh buffer, most of the copy's time is
the kernel mapping the new pages on first touch: 20.6 ms for a fresh 47 MB copy against 2.4 ms
into a buffer written before, and 28 ms against 8 ms for the prefill side's gather out of the
KV pools (AMD EPYC Zen 5, one thread). Large buffers come from mmap and go back at each free
(glibc's mmap threshold tops out at 32 MB), so every handoff paid it again. A `StagingBuffers`
keeps a few buffers it handed out for the next handoff: the prefill side gathers into one and
sends from it, the receiving side reads the wire into one; each is given back once its bytes
are no longer needed (sent; installed into the pools).
"""

from __future__ import annotations

import threading

import torch

__all__ = ["StagingBuffers"]


class StagingBuffers:
    """Up to `keep` idle buffers, none over `max_bytes` (a larger one is not kept: a rare huge
    handoff does not stay resident). `take(n)` returns a uint8 tensor of exactly `n` bytes, a
    view of a kept buffer when one is large enough; `give` returns it. Thread-safe."""

    def __init__(self, keep: int = 2, max_bytes: int = 256 << 20) -> None:
        self.keep, self.max_bytes = keep, max_bytes
        self._idle: list[torch.Tensor] = []  # whole buffers, smallest first
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            for i, buffer in enumerate(self._idle):
                if buffer.numel() >= nbytes:
                    return self._idle.pop(i)[:nbytes]
        return torch.empty(nbytes, dtype=torch.uint8)

    def give(self, view: torch.Tensor) -> None:
        """Keep `view`'s whole buffer (a tensor `take` returned) for a later `take`."""
        buffer = view if view._base is None else view._base
        if buffer.dtype != torch.uint8 or buffer.numel() > self.max_bytes:
            return
        with self._lock:
            if any(kept.data_ptr() == buffer.data_ptr() for kept in self._idle):
                return  # given twice
            self._idle.append(buffer)
            self._idle.sort(key=torch.Tensor.numel)
            if len(self._idle) > self.keep:
                self._idle.pop(0)  # the smallest goes

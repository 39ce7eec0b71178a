"""`engine_ref.core.staging.StagingBuffers`: a buffer given back is handed out again (the point:
its pages are already mapped), the smallest that fits; no more than `keep` idle, none over
`max_bytes`; a buffer given twice is kept once."""

from __future__ import annotations

import torch

from engine_ref.core.staging import StagingBuffers


def test_a_given_buffer_is_taken_again_smallest_that_fits_first():
    staging = StagingBuffers(keep=2)
    big, small = staging.take(1000), staging.take(100)
    assert (big.numel(), small.numel(), big.dtype) == (1000, 100, torch.uint8)
    staging.give(big)
    staging.give(small)
    again = staging.take(100)  # exactly the small one's size: the small one
    assert again.data_ptr() == small.data_ptr() and again.numel() == 100
    part = staging.take(101)  # more than the small one: the big one, cut to size
    assert part.data_ptr() == big.data_ptr() and part.numel() == 101
    fresh = staging.take(5000)  # more than any kept: a new buffer
    assert fresh.data_ptr() not in (big.data_ptr(), small.data_ptr())
    staging.give(part)  # a view goes back as its whole buffer
    assert staging.take(1000).data_ptr() == big.data_ptr()


def test_at_most_keep_idle_none_too_large_and_none_twice():
    staging = StagingBuffers(keep=2, max_bytes=10_000)
    a, b, c = staging.take(10), staging.take(20), staging.take(30)
    huge = staging.take(10_001)
    for buffer in (a, b, c, huge, c):
        staging.give(buffer)
    kept = sorted(t.numel() for t in staging._idle)
    assert kept == [20, 30]  # the smallest went; the huge one was not kept; c once
    # With nothing kept, every take is new (keep=0: the staging is off).
    off = StagingBuffers(keep=0)
    first = off.take(64)
    off.give(first)
    assert off._idle == []

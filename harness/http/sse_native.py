"""The compiled scanner of common OpenAI streams (`sse_scan.c`), built and loaded on demand.

`scan(reads, chat)` returns a `Scan` of one whole stream's events as arrays, or None when the
stream is anything but the common form (the Python parser in `harness.http.sse` then decides), or
when there is no scanner: no C compiler, a failed build, or `BENCH_NATIVE_SSE=0`. The scanner
reads only `content`, so a stream with reasoning (a delta whose `reasoning_content` or
`reasoning` is not null, which the scanner gives up on as it reads the key, or a `<think>` tag
in the joined text, one search of it here: `harness.http.reasoning`) is left to the Python
parser too. The library
is built once per source (about a second with `cc -O2`) into the user cache, written to a
temporary name and renamed, so processes that build at once never load half a file.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from array import array
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench_common.cache import CacheArea, cache_area
from bench_common.think_tags import OPEN_TAG

_OPEN_TAG_BYTES = OPEN_TAG.encode()

SOURCE = Path(__file__).with_name("sse_scan.c")
NONE_USAGE = np.iinfo(np.int64).min  # the scanner's "this event carries no usage so far"

_lib: ctypes.CDLL | None = None
_tried = False


@dataclass(slots=True)
class Scan:
    """One stream's events (`[DONE]` not counted), as the scanner read them."""

    t_ns: np.ndarray  # int64: the time of the read that completed each event
    chars: np.ndarray  # int32: code points of each event's text (0: no text)
    text_id: np.ndarray  # int32: the event's distinct text, in order of first use; -1: none
    usage: np.ndarray  # int64: the usage so far the event carries; NONE_USAGE: none
    n_ids: np.ndarray  # int32: the length of the event's token_ids; -1: none
    text: bytes  # every event's text, joined, UTF-8
    distinct: list[bytes]  # each distinct text's UTF-8 bytes
    saw_done: bool
    response_id: bytes | None  # raw JSON spans, decoded by the caller
    finish_reason: bytes | None
    usage_object: bytes | None


def library_path() -> Path:
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    return cache_area(CacheArea.NATIVE) / f"sse_scan-{digest}.so"


def _build(path: Path) -> bool:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        done = subprocess.run(
            [compiler, "-O2", "-std=c99", "-shared", "-fPIC", "-o", tmp, str(SOURCE)],
            capture_output=True,
            timeout=120,
        )
        if done.returncode != 0:
            return False
        os.replace(tmp, path)
        return True
    except (OSError, subprocess.SubprocessError):
        return False
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def library() -> ctypes.CDLL | None:
    """The loaded scanner, built first if needed; None where it cannot be had."""
    global _lib, _tried
    if os.environ.get("BENCH_NATIVE_SSE", "1") == "0":
        return None
    if _tried:
        return _lib
    _tried = True
    try:
        path = library_path()
        if not path.exists() and not _build(path):
            return None
        lib = ctypes.CDLL(str(path))
    except OSError:
        return None
    p = ctypes.c_void_p
    i64 = ctypes.c_int64
    lib.sse_scan.restype = i64
    lib.sse_scan.argtypes = [p, i64, p, p, i64, ctypes.c_int32, ctypes.POINTER(_Buffers)]
    _lib = lib
    return lib


def available() -> bool:
    return library() is not None


def _ptr(values: np.ndarray) -> int:
    return values.__array_interface__["data"][0]


_BUFFER_POINTERS = ("ev_t", "ev_usage", "ev_chars", "ev_bytes", "ev_text", "ev_ids", "text",
                    "first_of_text", "slot_of_text", "text_start", "table")  # fmt: skip


class _Buffers(ctypes.Structure):
    """`sse_scan.c`'s Buffers: where the scanner writes, set once per size of the scratch."""

    _fields_ = [
        ("cap", ctypes.c_int64),
        *((name, ctypes.c_void_p) for name in _BUFFER_POINTERS),
        ("table_size", ctypes.c_int64),
        ("info", ctypes.c_void_p),
    ]


class _Scratch(threading.local):
    """Per-thread buffers, grown as needed and reused: fresh ones would cost page faults."""

    def __init__(self) -> None:
        self.cap = self.n = 0
        self.buffers = _Buffers()

    def ensure(self, n: int, cap: int) -> None:
        if n <= self.n and cap <= self.cap:
            return
        if n > self.n:
            self.n = max(n, 2 * self.n)
            self.text = np.empty(self.n, np.uint8)
        if cap > self.cap:
            self.cap = max(cap, 2 * self.cap)
            self.wide = np.empty((3, self.cap), np.int64)  # time, usage, text start
            self.ints = np.empty((6, self.cap), np.int32)  # chars, bytes, text id, ids, first, slot
            # every slot -1 between scans (the scanner empties the ones it fills)
            self.table = np.full(1 << (2 * self.cap - 1).bit_length(), -1, np.int32)
            self.info = np.empty(10, np.int64)
        wide = [_ptr(self.wide) + i * self.wide.strides[0] for i in range(3)]
        ints = [_ptr(self.ints) + i * self.ints.strides[0] for i in range(6)]
        self.buffers = _Buffers(
            self.cap, wide[0], wide[1], ints[0], ints[1], ints[2], ints[3], _ptr(self.text),
            ints[4], ints[5], wide[2], _ptr(self.table), len(self.table), _ptr(self.info),
        )  # fmt: skip


_scratch = _Scratch()


def scan(reads: list[tuple[int, bytes]], *, chat: bool) -> Scan | None:
    """Scan one whole stream; None: not the common form, or no scanner."""
    lib = library()
    if lib is None or not reads:
        return None
    times, datas = zip(*reads, strict=True)
    stream = b"".join(datas)
    n = len(stream)
    if n == 0:
        return None
    read_lengths = array("q", map(len, datas))
    read_times = array("q", times)
    b = _scratch
    b.ensure(n, n // 9 + 1)  # the most events `n` bytes can hold: `data: X\n\n` is 9 bytes
    status = lib.sse_scan(
        stream, n, read_lengths.buffer_info()[0], read_times.buffer_info()[0], len(reads), chat,
        b.buffers,
    )  # fmt: skip
    if status != 0:
        return None
    info = b.info.tolist()
    count, saw_done, text_len, n_distinct = info[:4]
    text_bytes = b.text[:text_len].tobytes()
    if _OPEN_TAG_BYTES in text_bytes:
        return None
    wide = b.wide[:, :count].copy()
    ints = b.ints[:4, :count].copy()
    starts = b.wide[2, :n_distinct].tolist()
    lengths = b.ints[1][b.ints[4, :n_distinct]].tolist() if n_distinct else []
    distinct = [text_bytes[s : s + k] for s, k in zip(starts, lengths, strict=True)]

    def span(i: int) -> bytes | None:
        return stream[info[i] : info[i + 1]] if info[i] >= 0 else None

    return Scan(
        t_ns=wide[0],
        chars=ints[0],
        text_id=ints[2],
        usage=wide[1],
        n_ids=ints[3],
        text=text_bytes,
        distinct=distinct,
        saw_done=bool(saw_done),
        response_id=span(4),
        finish_reason=span(6),
        usage_object=span(8),
    )

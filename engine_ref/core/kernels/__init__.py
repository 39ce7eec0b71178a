"""The reference engine's own GEMMs and decoder layer for small batches (`lowbit.cpp`, AVX2 +
FMA).

torch's CPU int4 kernel (`aten::_weight_int4pack_mm_for_cpu`) widens its weights through
shuffles and runs at about 4 G weights/s on one core of this project's machine, compute-bound
at SmolLM2's shapes, so a 4-bit decode step streamed its weights at a fraction of the memory
bandwidth. `refkern::q4_gemm` reads a layout made for AVX2 (one 32-byte load, a mask per
nibble, no shuffles) and `refkern::q8_gemm` widens int8 rows in registers; both accumulate in
float32 from float32 activations and split output rows over torch's intra-op threads.
`refkern::f32_gemm` does the same for float32 weights: each weight row is read once for up to
8 activation rows, where torch's GEMM took 1.7x its one-row time for 5 rows, which made a
speculative verify step cost much more than a decode step. `refkern::decode_layer` runs a
whole decoder layer (int4 or float32 projections) for up to `SMALL_BATCH_ROWS` causal rows
(`DENSE_SMALL_BATCH_ROWS` for float32) in one call (see lowbit.cpp). With them a SmolLM2 W4A16
decode step went from 40.2 to 12.5 ms at 2 threads, its weight GEMMs from 13.1 to 8.5 ms and
the rest from 27.1 to 4.0 ms (`benchmarks/quantization.py --modes float32,w4a16-torch,w4a16
--threads 2 --profile`). At SmolLM2's shapes with hot weights, torch's int4 kernel was faster
from about 32 rows on (measured while writing these), so the int4 layers use these for at
most `SMALL_BATCH_ROWS` rows.

The extension is compiled once per torch version and source (about 20 s) into the bench
cache: in the foreground by the first quantized engine (and the tests), in a detached
low-priority process by the first float32 engine, which runs torch's kernels meanwhile so a
server's start is not held. It is loaded as a torch library, so a
profiler sees `refkern::q4_gemm`, `refkern::f32_gemm` and the rest like any aten op. Without a
C++ compiler, ninja or AVX2 + FMA + F16C, or with `BENCH_REF_KERNELS=0`, `available()` is
false, the reason is in `unavailable_reason()`, and the layers run torch's kernels alone.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import torch

from bench_common.cache import CacheArea, cache_area

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("lowbit.cpp")
# The most activation rows a call sends to the low-bit kernels; more go to torch's.
SMALL_BATCH_ROWS = 16
# The same bound for `f32_gemm` and a float32 `decode_layer`. At SmolLM2's shapes (2 threads)
# the f32 head GEMM took 24.7 against torch's 31.7 ms at 32 rows, 32.8 against 38.0 at 48 and
# 48.8 against 48.3 at 64; a whole float32 decode step of 48 rows took 211 against 232-305 ms.
DENSE_SMALL_BATCH_ROWS = 48
# The int4 group along K that q4_gemm's scales and minima cover.
GROUP = 32
# K must be a multiple of these (the layouts' unit along the input dimension).
Q4_K_MULTIPLE = 64
Q8_K_MULTIPLE = 16
F32_K_MULTIPLE = 16
DISABLE_ENV = "BENCH_REF_KERNELS"

_lock = threading.Lock()
_state: dict[str, object] = {}


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def missing_prerequisite() -> str | None:
    """Why the kernels cannot even be built here (switched off, CPU flags, no compiler or
    ninja), in a few words; None when a build can be tried."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return f"{DISABLE_ENV}=0"
    missing = {"avx2", "fma", "f16c"} - _cpu_flags()
    if missing:
        return f"this CPU lacks {', '.join(sorted(missing))}"
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler on PATH"
    from torch.utils.cpp_extension import is_ninja_available

    if not is_ninja_available():
        return "ninja is not installed"
    return None


def _build_dir() -> Path:
    digest = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode()).hexdigest()[:12]
    path = cache_area(CacheArea.KERNELS) / f"refkern-{digest}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _load() -> None:
    reason = missing_prerequisite()
    if reason is None:
        try:
            from torch.utils.cpp_extension import load

            load(
                name="refkern",
                sources=[str(SOURCE)],
                # -fopenmp: at::parallel_for is inline OpenMP; libgomp.so.1 resolves to the
                # copy torch already loaded, so both share one thread pool.
                extra_cflags=["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                build_directory=str(_build_dir()),
                is_python_module=False,
                verbose=False,
            )
            torch.ops.refkern.q4_gemm  # noqa: B018 - raises if the library did not register
        except Exception as exc:  # a failed build must leave torch's kernels in charge
            reason = f"the kernel build failed: {_first_error(exc)}"
    if reason is not None:
        log.info("engine_ref low-bit kernels off (%s); torch's kernels run instead", reason)
    _state["reason"] = reason


def _first_error(exc: Exception) -> str:
    """The compiler's first `error:` line of a failed build (the exception's first line is
    ninja's command), else the exception's first line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return next((line for line in lines if "error:" in line), lines[0] if lines else repr(exc))


def _built() -> bool:
    """The library is in the cache and no build of it is under way (torch's build lock)."""
    path = _build_dir()
    return (path / "refkern.so").is_file() and not (path / "lock").exists()


def _build_in_background() -> None:
    """Build the library in a detached, low-priority process (once per process), so the
    next engine finds it; it outlives this process if this one exits first."""
    if _state.get("background"):
        return
    _state["background"] = True
    nice = ["nice", "-n", "19"] if shutil.which("nice") else []
    code = "from engine_ref.core import kernels; kernels.available()"
    subprocess.Popen([*nice, sys.executable, "-c", code], stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     start_new_session=True)  # fmt: skip


def available(build: bool = True) -> bool:
    """True when the `refkern` ops are loaded. The first call builds them (about 20 s) unless
    `build` is false: then, when they are not built yet, it starts a background build for
    the next engine and returns False, leaving a later call free to build or load them."""
    with _lock:
        if "reason" not in _state:
            if not build and missing_prerequisite() is None and not _built():
                _build_in_background()
                log.info("engine_ref kernels not built yet: building them in the background")
                return False
            _load()
    return _state["reason"] is None


def unavailable_reason() -> str | None:
    """Why the kernels are off, in a few words; None when they run."""
    available()
    return _state["reason"]  # type: ignore[return-value]


def pack_q4(q: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K / 2] in `q4_gemm`'s layout from q [N, K] (values 0..15, K a multiple of 64):
    each 64 weights become 8 little-endian uint32 lanes, lane j holding q[8 t + j] in bits
    4 t .. 4 t + 3."""
    n, k = q.shape
    if k % Q4_K_MULTIPLE:
        raise ValueError(f"pack_q4 needs K a multiple of {Q4_K_MULTIPLE}, got {k}")
    nibbles = q.to(torch.int64).view(n, k // 64, 8, 8)  # [N, chunk, t, j]
    shifts = (4 * torch.arange(8, dtype=torch.int64)).view(1, 1, 8, 1)
    lanes = (nibbles << shifts).sum(dim=2)  # [N, chunk, j], each < 2^32
    byte_shifts = (8 * torch.arange(4, dtype=torch.int64)).view(1, 1, 1, 4)
    packed = ((lanes.unsqueeze(-1) >> byte_shifts) & 0xFF).to(torch.uint8)
    return packed.reshape(n, k // 2).contiguous()


def q4_gemm(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor
) -> torch.Tensor:
    """float32 [M, N] = x [M, K] @ W.T, W[n, 32 g + i] = q * scale[n, g] + minimum[n, g];
    scale and minimum are float16 (as Q4_1 stores them; wider ones are rounded to it)."""
    scale, minimum = scale.half().contiguous(), minimum.half().contiguous()
    return torch.ops.refkern.q4_gemm(x.float().contiguous(), packed, scale, minimum)


def q8_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 [M, N] = x [M, K] @ (weight * scale[:, None]).T for int8 weight [N, K]."""
    return torch.ops.refkern.q8_gemm(x.float().contiguous(), weight, scale)


def f32_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """float32 [M, N] = x [M, K] @ weight.T for float32 weight [N, K] (K a multiple of 16)."""
    return torch.ops.refkern.f32_gemm(x.float().contiguous(), weight)


def dense_ok(weight: torch.Tensor) -> bool:
    """Whether `f32_gemm` (and `decode_layer`) can take this weight as it is held. A float32
    engine does not wait for a first build (it would hold a server's start by some 20 s): it
    runs torch's kernels until a later engine finds the library built."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and weight.is_contiguous()
        and weight.shape[1] % F32_K_MULTIPLE == 0
        and available(build=False)
    )

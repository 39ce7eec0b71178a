"""The reference engine's own GEMMs and decoder layer for small batches (`*.cpp` here), built
once per instruction set and chosen at run time by what the processor offers.

Instruction-set levels (`ISA_LEVELS`, lowest first): `avx2` (AVX2 + FMA + F16C), `avx512`
(AVX-512 F/BW/VL/DQ), `avx512-bf16` (adds AVX-512 BF16 and VNNI), `amx` (adds AMX tiles, BF16
and INT8). The first engine of a process picks the highest level whose flags `/proc/cpuinfo`
lists, or the level `BENCH_REF_ISA` names (a ceiling: a level above what the CPU offers turns
the kernels off, with the reason), compiles every source here with that level's flags
(`-mavx512f`, ...) into one library in the bench cache, and loads it as the torch library
`refkern`; one level per process. Code inside the sources picks its vector width with
`#ifdef __AVX512F__` and the like, so a lower level is the same source built with fewer flags.
`active_isa()` names the level that runs, `describe()` says it for `/info`, manifests and
cards ("avx512-bf16", or "off: <reason>").

torch's CPU int4 kernel (`aten::_weight_int4pack_mm_for_cpu`) widens its weights through
shuffles and runs at about 4 G weights/s on one core of this project's machine, compute-bound
at SmolLM2's shapes, so a 4-bit decode step streamed its weights at a fraction of the memory
bandwidth. `refkern::q4_gemm` reads a layout made for AVX2 (one 32-byte load, a mask per
nibble, no shuffles) and `refkern::q8_gemm` widens int8 rows in registers; both accumulate in
float32 from float32 activations and split output rows over torch's intra-op threads.
`refkern::f32_gemm` does the same for float32 weights: each weight row is read once for up to
8 activation rows, where torch's GEMM took 1.7x its one-row time for 5 rows, which made a
speculative verify step cost much more than a decode step. `refkern::decode_layer`
(layer.cpp) runs a whole decoder layer (int4, float32 or bfloat16 projections over a KV
pool in any `--kv-cache-dtype` storage, `engine_ref.core.kv_dtype`) for up to
`SMALL_BATCH_ROWS` causal rows (`DENSE_SMALL_BATCH_ROWS` for float32 and bfloat16) in one
call; `refkern::bf16_gemm` (bf16.cpp) is a bfloat16 head's, `refkern::q4_i8_gemm` and
`q8_i8_gemm` (int8.cpp) W4A8's and W8A8's, and `refkern::paged_attention_decode`
(paged_attention.cpp) attends decode rows above the bound. The two attention kernels store
and read the KV formats through one header (kv_formats.h). With
them a SmolLM2 W4A16 decode step went from 40.2 to 12.5 ms at 2 threads, its weight GEMMs
from 13.1 to 8.5 ms and the rest from 27.1 to 4.0 ms (`benchmarks/quantization.py --modes
float32,w4a16-torch,w4a16 --threads 2 --profile`). At SmolLM2's shapes with hot weights, torch's int4 kernel was faster
from about 32 rows on (measured while writing these), so the int4 layers use these for at
most `SMALL_BATCH_ROWS` rows.

The library is compiled once per torch version, level and source (about 20 s) into the bench
cache: in the foreground by the first quantized engine (and the tests), in a detached
low-priority process by the first float32 engine, which runs torch's kernels meanwhile so a
server's start is not held. It is loaded as a torch library, so a profiler sees
`refkern::q4_gemm`, `refkern::f32_gemm` and the rest like any aten op. Without a C++
compiler, ninja or AVX2 + FMA + F16C, with `BENCH_REF_KERNELS=0`, or when the build fails,
`available()` is false, the reason is in `unavailable_reason()`, and the layers run torch's
kernels alone.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from bench_common.cache import CacheArea, cache_area

log = logging.getLogger(__name__)

KERNEL_DIR = Path(__file__).parent
# Every C++ source here goes into the one library (`_unity_source`); headers count in its
# cache key.
SOURCES = tuple(sorted(KERNEL_DIR.glob("*.cpp")))
HEADERS = tuple(sorted(KERNEL_DIR.glob("*.h")))
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
ISA_ENV = "BENCH_REF_ISA"
BACKGROUND_BUILD_ENV = "BENCH_REF_BACKGROUND_BUILD"


@dataclass(frozen=True)
class IsaLevel:
    """One instruction-set level: the `/proc/cpuinfo` flags it needs (its own and every lower
    level's) and the compiler flags its library is built with."""

    name: str
    cpu_flags: frozenset[str]
    cflags: tuple[str, ...]


def _ladder() -> tuple[IsaLevel, ...]:
    steps = (
        ("avx2", ("avx2", "fma", "f16c"), ("-mavx2", "-mfma", "-mf16c")),
        ("avx512", ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
         ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")),
        ("avx512-bf16", ("avx512_bf16", "avx512_vnni"), ("-mavx512bf16", "-mavx512vnni")),
        ("amx", ("amx_tile", "amx_bf16", "amx_int8"), ("-mamx-tile", "-mamx-bf16", "-mamx-int8")),
    )  # fmt: skip
    levels, flags, cflags = [], frozenset(), ()
    for name, cpu, cc in steps:
        flags, cflags = flags | frozenset(cpu), cflags + cc
        levels.append(IsaLevel(name, flags, cflags))
    return tuple(levels)


ISA_LEVELS = _ladder()
ISA_NAMES = tuple(level.name for level in ISA_LEVELS)

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


def isa_env_problem() -> str | None:
    """One sentence when `BENCH_REF_ISA` is set to something that is not a level name."""
    value = os.environ.get(ISA_ENV, "").strip()
    if value and value not in ISA_NAMES:
        return f"{ISA_ENV}={value!r} is not an instruction-set level; use one of {', '.join(ISA_NAMES)}."
    return None


def best_isa(flags: set[str] | None = None) -> IsaLevel | None:
    """The highest level this CPU (or `flags`) offers; None below AVX2 + FMA + F16C."""
    flags = _cpu_flags() if flags is None else flags
    offered = [level for level in ISA_LEVELS if level.cpu_flags <= flags]
    return offered[-1] if offered else None


def select_isa() -> tuple[IsaLevel | None, str | None]:
    """(the level to build, None) or (None, why the kernels cannot run here): the CPU's best
    level, or the one `BENCH_REF_ISA` names when the CPU offers it."""
    problem = isa_env_problem()
    if problem is not None:
        return None, problem.rstrip(".")
    flags = _cpu_flags()
    wanted = os.environ.get(ISA_ENV, "").strip()
    if wanted:
        level = ISA_LEVELS[ISA_NAMES.index(wanted)]
        missing = level.cpu_flags - flags
        if missing:
            return (
                None,
                f"{ISA_ENV}={wanted} needs {', '.join(sorted(missing))}, which this CPU lacks",
            )
        return level, None
    level = best_isa(flags)
    if level is None:
        missing = ISA_LEVELS[0].cpu_flags - flags
        return None, f"this CPU lacks {', '.join(sorted(missing))}"
    return level, None


def missing_prerequisite() -> str | None:
    """Why the kernels cannot even be built here (switched off, CPU flags, a bad
    `BENCH_REF_ISA`, no compiler or ninja), in a few words; None when a build can be tried."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return f"{DISABLE_ENV}=0"
    _, reason = select_isa()
    if reason is not None:
        return reason
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler on PATH"
    from torch.utils.cpp_extension import is_ninja_available

    if not is_ninja_available():
        return "ninja is not installed"
    return None


def _library_name(level: IsaLevel) -> str:
    return "refkern_" + level.name.replace("-", "_")


def _build_dir(level: IsaLevel) -> Path:
    digest = hashlib.sha256(torch.__version__.encode() + " ".join(level.cflags).encode())
    for path in SOURCES + HEADERS:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    path = cache_area(CacheArea.KERNELS) / f"refkern-{level.name}-{digest.hexdigest()[:12]}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _load() -> None:
    reason = missing_prerequisite()
    level = None
    if reason is None:
        level, _ = select_isa()
        library = _build_dir(level) / f"{_library_name(level)}.so"
        try:
            from torch.utils.cpp_extension import load

            if _is_built(library):
                # Built from these very sources and flags (the directory's name hashes them):
                # load it as it is. torch's `load` would ask ninja, whose build file names the
                # sources by absolute path, so a checkout at another path (a CI clone, a
                # reinstall) rebuilt it for some 30 s in the middle of a server's start.
                torch.ops.load_library(str(library))
            else:
                load(
                    name=_library_name(level),
                    sources=[str(_unity_source(library.parent))],
                    # -fopenmp: at::parallel_for is inline OpenMP; libgomp.so.1 resolves to
                    # the copy torch already loaded, so both share one thread pool.
                    extra_cflags=["-O3", *level.cflags, "-fopenmp"],
                    extra_ldflags=["-fopenmp"],
                    build_directory=str(library.parent),
                    is_python_module=False,
                    verbose=False,
                )
            torch.ops.refkern.q4_gemm  # noqa: B018 - raises if the library did not register
        except Exception as exc:  # a failed build must leave torch's kernels in charge
            reason = f"the {level.name} kernel build failed: {_first_error(exc)}"
    if reason is not None:
        log.info("engine_ref kernels off (%s); torch's kernels run instead", reason)
    _state["reason"] = reason
    _state["isa"] = level.name if reason is None else None


def _unity_source(build_dir: Path) -> Path:
    """One translation unit that includes every source: each source alone parses torch's
    headers for some 5-7 s, so the five built one by one took 46 s of CPU (about 30 s on two
    free cores) where this takes about 20 s on one. The sources share no names outside their
    own anonymous namespaces, and each still compiles on its own."""
    unity = build_dir / "refkern_all.cpp"
    text = "".join(f'#include "{path}"\n' for path in SOURCES)
    if not unity.is_file() or unity.read_text() != text:
        unity.write_text(text)
    return unity


def _first_error(exc: Exception) -> str:
    """The compiler's first `error:` line of a failed build (the exception's first line is
    ninja's command), else the exception's first line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return next((line for line in lines if "error:" in line), lines[0] if lines else repr(exc))


def _built() -> bool:
    """The library is in the cache and no build of it is under way (torch's build lock)."""
    level, _ = select_isa()
    return _is_built(_build_dir(level) / f"{_library_name(level)}.so")


def _is_built(library: Path) -> bool:
    return library.is_file() and not (library.parent / "lock").exists()


def _build_in_background() -> None:
    """Build the library in a detached process (once per process), so the next engine finds
    it; it outlives this process if this one exits first.

    It runs at the lowest priority (`nice -n 19`, and Linux's SCHED_IDLE policy unless
    `BENCH_REF_BACKGROUND_BUILD=normal`), in a process group of its own (a Ctrl-C in the
    terminal does not reach it) but in this session: Linux groups the scheduling of each
    session (autogroup), so a build in a session of its own took an equal share of the 2
    cores from the engine whatever its nice value; a newcomer's first sharegpt run took 96 and
    109 s against 71 s before the bfloat16 kernels existed."""
    if _state.get("background"):
        return
    _state["background"] = True
    level, _ = select_isa()
    if (_build_dir(level) / "lock").exists():
        return  # another process builds it (one waiting build per process would pile up)
    nice = ["nice", "-n", "19"] if shutil.which("nice") else []
    code = "from engine_ref.core import kernels; kernels.available()"
    if os.environ.get(BACKGROUND_BUILD_ENV, "idle") != "normal":
        code = f"{_SCHED_IDLE}\n{code}"
    # Held for the life of the process: a Popen collected while its child runs warns.
    _state["background"] = subprocess.Popen(
        [*nice, sys.executable, "-c", code], stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, process_group=0)  # fmt: skip


# The background build's first statement: every process it starts (ninja, the compiler)
# inherits the policy; where there is no such policy, nice alone.
_SCHED_IDLE = """import os
try:
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
except (AttributeError, OSError):
    pass"""


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


def active_isa() -> str | None:
    """The instruction-set level whose library runs (`ISA_NAMES`), None when the kernels are
    off. Does not build: before the first engine loads them it says None."""
    return _state.get("isa")  # type: ignore[return-value]


def describe() -> str:
    """What runs, for `/info`, manifests and cards: a level name, "off: <reason>", or "not
    loaded" before any engine asked for them."""
    if "reason" not in _state:
        return "building: torch's kernels run" if _state.get("background") else "not loaded"
    return _state["isa"] or f"off: {_state['reason']}"  # type: ignore[return-value]


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

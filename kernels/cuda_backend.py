"""The CUDA backend: the kernels of ``kernels/*.cu`` launched through CuPy.

Torch tensors go in and come out; the launchers hand them to CuPy without a copy
(DLPack) and launch on torch's current CUDA stream of the tensors' device. Each source
file is compiled once per device (a ``cupy.RawModule`` with every name expression of
:func:`instantiations`), on first use.

CuPy is imported lazily: this module imports on a machine with no GPU and no CuPy, and
:func:`instantiations`, :func:`load_source` and the launch heuristics work there (the
NVRTC compile check, ``kernels.nvrtc_check``, uses them).
"""

from __future__ import annotations

import math
import re
import threading
from pathlib import Path

import torch

from kernels import checks
from kernels.backend import BLOCK_SIZES, DTYPES, HEAD_DIMS

KERNEL_DIR = Path(__file__).resolve().parent
ATTENTION_SOURCE = "paged_attention.cu"
CACHE_OPS_SOURCE = "cache_ops.cu"

#: Compile options (NVRTC); the target architecture is added by CuPy or the check.
COMPILE_OPTIONS = ("-std=c++17",)

#: The template tag of each cache dtype (``kv_types.cuh``).
TYPE_TAGS = {torch.float32: "kv_f32", torch.float16: "kv_f16", torch.bfloat16: "kv_bf16"}
#: Query/head rows per attention CTA (template argument ROWS).
ATTENTION_ROWS = (1, 2, 4, 8)
#: Copy units of the cache kernels, by size in bytes.
COPY_UNITS = {16: "kv_u128", 8: "unsigned long long", 4: "unsigned int", 2: "unsigned short"}

#: Threads of one attention CTA (PA_THREADS in paged_attention.cu) and its warps.
ATTENTION_THREADS = 128
ATTENTION_WARPS = ATTENTION_THREADS // 32
#: Split-K: fewest context tokens a split is given by the heuristic, and most splits.
MIN_TOKENS_PER_SPLIT = 512
MAX_SPLITS = 64


# --- instantiations (the one list the launchers and the compile check share) ---------

def attention_kernel_name(dtype: torch.dtype, head_dim: int, rows: int) -> str:
    return f"paged_attention_kernel<{TYPE_TAGS[dtype]}, {head_dim}, {rows}>"


def reduce_kernel_name(dtype: torch.dtype) -> str:
    return f"paged_attention_reduce_kernel<{TYPE_TAGS[dtype]}>"


def reshape_kernel_name(unit: int) -> str:
    return f"reshape_and_cache_kernel<{COPY_UNITS[unit]}>"


def copy_blocks_kernel_name(unit: int) -> str:
    return f"copy_blocks_kernel<{COPY_UNITS[unit]}>"


def instantiations() -> dict[str, list[str]]:
    """Every kernel instantiation a launcher can request: source file -> name expressions.

    The launchers only ask for names built by the ``*_kernel_name`` functions above from
    values in ``DTYPES``, ``HEAD_DIMS``, ``ATTENTION_ROWS`` and ``COPY_UNITS`` (block size
    is a run-time argument), and each ``RawModule`` is built with exactly this list, so a
    name missing here fails at once on a GPU and in the CPU compile check alike.
    """
    attention = [attention_kernel_name(dt, d, r) for dt in DTYPES for d in HEAD_DIMS
                 for r in ATTENTION_ROWS]
    attention += [reduce_kernel_name(dt) for dt in DTYPES]
    cache_ops = [reshape_kernel_name(u) for u in COPY_UNITS]
    cache_ops += [copy_blocks_kernel_name(u) for u in COPY_UNITS]
    return {ATTENTION_SOURCE: attention, CACHE_OPS_SOURCE: cache_ops}


_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.M)


def load_source(file: str, _seen: frozenset[str] = frozenset()) -> str:
    """The text of ``kernels/<file>`` with its local ``#include "..."`` files inlined.

    Inlining keeps the compile self-contained (no include path) and makes the whole text
    the key of CuPy's kernel cache, headers included.
    """
    if file in _seen:
        raise ValueError(f"{file} includes itself")
    text = (KERNEL_DIR / file).read_text()

    def inline(match: re.Match) -> str:
        name = match.group(1)
        if not (KERNEL_DIR / name).exists():
            raise FileNotFoundError(f"{file}: included file {name} not found in {KERNEL_DIR}")
        return f'// ---- begin {name}\n{load_source(name, _seen | {file})}\n// ---- end {name}\n'

    return _INCLUDE.sub(inline, text)


# --- launch heuristics (pure functions, testable without a GPU) -------------------

def attention_rows(num_tokens: int, num_seqs: int, group: int) -> tuple[int, int]:
    """``(ROWS, slot_pad)`` for an attention launch.

    Decode-shaped batches (no more query tokens than sequences) put a whole query-head
    group in one CTA (ROWS = the smallest of 1, 2, 4, 8 that holds it, 8 for larger
    groups); batches with longer query runs use 8 rows (query tokens x heads). slot_pad is
    1 only when ROWS does not divide the group (then a sequence may need one tile more
    than its share of slots; see paged_attention.cu).
    """
    if num_tokens <= num_seqs:
        rows = next((r for r in ATTENTION_ROWS if r >= min(group, 8)), ATTENTION_ROWS[-1])
    else:
        rows = ATTENTION_ROWS[-1]
    return rows, (0 if group % rows == 0 else 1)


def attention_slots(num_tokens: int, num_seqs: int, group: int, rows: int, slot_pad: int) -> int:
    """Row-tile slots (grid.x) of an attention launch."""
    return (num_tokens * group) // rows + slot_pad * num_seqs


def choose_num_splits(num_ctas: int, max_context: int, sm_count: int) -> int:
    """Split-K factor that fills the GPU: about 2 CTAs per multiprocessor.

    No split when the launch already has ``2 * sm_count`` CTAs or the context is short;
    otherwise enough splits to reach ``2 * sm_count`` CTAs, each split keeping at least
    ``MIN_TOKENS_PER_SPLIT`` tokens of the longest context, at most ``MAX_SPLITS``.
    ``max_context`` is an upper bound known without a device sync
    (``max_num_blocks * block_size``).
    """
    target = 2 * sm_count
    if num_ctas <= 0 or num_ctas >= target or max_context < 2 * MIN_TOKENS_PER_SPLIT:
        return 1
    splits = math.ceil(target / num_ctas)
    splits = min(splits, max_context // MIN_TOKENS_PER_SPLIT, MAX_SPLITS)
    return max(1, splits)


def attention_shared_bytes(head_dim: int, block_size: int, rows: int) -> int:
    """Dynamic shared memory of an attention CTA: per-warp scores, reused for the
    cross-warp reduction (accumulators, maxima, sums)."""
    scores = ATTENTION_WARPS * rows * block_size
    reduction = ATTENTION_WARPS * rows * head_dim + 2 * ATTENTION_WARPS * rows
    return 4 * max(scores, reduction)


def copy_unit(row_bytes: int, *tensors: torch.Tensor) -> int:
    """The widest copy unit (16, 8, 4, 2 bytes) dividing ``row_bytes`` and every pointer."""
    for unit in COPY_UNITS:
        if row_bytes % unit == 0 and all(t.data_ptr() % unit == 0 for t in tensors):
            return unit
    raise ValueError(f"tensors are not 2-byte aligned (row of {row_bytes} bytes)")


# --- compilation and launch -------------------------------------------------------

_modules: dict[tuple[int, str], object] = {}
_functions: dict[tuple[int, str], object] = {}
_lock = threading.Lock()


def _cupy():
    import cupy
    return cupy


def _function(device: torch.device, file: str, name: str):
    """The compiled kernel ``name`` of ``file`` on ``device`` (module compiled once)."""
    key = (device.index, name)
    fn = _functions.get(key)
    if fn is not None:
        return fn
    cupy = _cupy()
    names = instantiations()[file]
    if name not in names:
        raise KeyError(f"{name} is not an instantiation of {file}")
    with _lock, cupy.cuda.Device(device.index):
        mod = _modules.get((device.index, file))
        if mod is None:
            mod = cupy.RawModule(code=load_source(file), options=COMPILE_OPTIONS,
                                 name_expressions=names, backend="nvrtc")
            _modules[(device.index, file)] = mod
        fn = mod.get_function(name)
        _functions[key] = fn
    return fn


class _Launch:
    """Context: the tensors' device and torch's current stream on it, as CuPy's."""

    def __init__(self, device: torch.device):
        cupy = _cupy()
        self.device = cupy.cuda.Device(device.index)
        ptr = torch.cuda.current_stream(device).cuda_stream
        self.stream = cupy.cuda.ExternalStream(ptr, device.index)

    def __enter__(self):
        self.device.__enter__()
        self.stream.__enter__()
        return self

    def __exit__(self, *exc):
        self.stream.__exit__(*exc)
        self.device.__exit__(*exc)
        return False

    @staticmethod
    def arr(t: torch.Tensor):
        """A CuPy view of ``t`` (DLPack, no copy); 16-bit floats travel as int16."""
        if t.dtype in (torch.float16, torch.bfloat16):
            t = t.view(torch.int16)
        return _cupy().from_dlpack(t)


def _require_cuda(name: str, t: torch.Tensor) -> None:
    if t.device.type != "cuda":
        raise ValueError(f"{name} is on {t.device}; the cuda backend needs CUDA tensors")


def _require_aligned(name: str, t: torch.Tensor, align: int = 16) -> None:
    if t.data_ptr() % align != 0:
        raise ValueError(f"{name} must be {align}-byte aligned")


_sm_counts: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    n = _sm_counts.get(device.index)
    if n is None:
        n = torch.cuda.get_device_properties(device).multi_processor_count
        _sm_counts[device.index] = n
    return n


class CudaBackend:
    """KVBackend over the CUDA kernels. All tensors on one CUDA device."""

    name = "cuda"

    def reshape_and_cache(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """key, value ``[num_tokens, num_kv_heads, head_dim]``; k_cache, v_cache
        ``[num_blocks, num_kv_heads, block_size, head_dim]``; slot_mapping int64
        ``[num_tokens]`` (slot < 0 skipped)."""
        checks.check_reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)
        _require_cuda("k_cache", k_cache)
        num_tokens = key.shape[0]
        if num_tokens == 0:
            return
        _, num_kv_heads, block_size, head_dim = k_cache.shape
        row_bytes = head_dim * k_cache.element_size()
        unit = copy_unit(row_bytes, key, value, k_cache, v_cache)
        fn = _function(k_cache.device, CACHE_OPS_SOURCE, reshape_kernel_name(unit))
        np = _numpy()
        threads = min(1024, max(32, num_kv_heads * row_bytes // unit))
        with _Launch(k_cache.device) as L:
            fn((min(num_tokens, 2**31 - 1),), (threads,),
               (L.arr(key), L.arr(value), L.arr(k_cache), L.arr(v_cache), L.arr(slot_mapping),
                np.int64(num_tokens), np.int32(num_kv_heads), np.int32(block_size),
                np.int32(row_bytes // unit)))

    def paged_attention(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, context_lens: torch.Tensor,
                        query_start_loc: torch.Tensor, scale: float, *,
                        num_splits: int | None = None) -> torch.Tensor:
        """query ``[num_query_tokens, num_heads, head_dim]``; k_cache, v_cache
        ``[num_blocks, num_kv_heads, block_size, head_dim]``; block_tables int32
        ``[num_seqs, max_num_blocks]``; context_lens int32 ``[num_seqs]``;
        query_start_loc int32 ``[num_seqs + 1]``. Returns
        ``[num_query_tokens, num_heads, head_dim]`` in the query's dtype."""
        checks.check_paged_attention(query, k_cache, v_cache, block_tables, context_lens,
                                     query_start_loc, num_splits)
        _require_cuda("k_cache", k_cache)
        _require_aligned("k_cache", k_cache)
        _require_aligned("v_cache", v_cache)
        _, num_kv_heads, block_size, head_dim = k_cache.shape
        if head_dim not in HEAD_DIMS:
            raise ValueError(f"k_cache: head_dim {head_dim} is not one of {HEAD_DIMS}")
        if block_size not in BLOCK_SIZES:
            raise ValueError(f"k_cache: block_size {block_size} is not one of {BLOCK_SIZES}")
        num_tokens, num_heads, _ = query.shape
        num_seqs, max_num_blocks = block_tables.shape
        out = torch.empty_like(query)
        if num_tokens == 0 or num_seqs == 0:
            return out
        group = num_heads // num_kv_heads
        rows, slot_pad = attention_rows(num_tokens, num_seqs, group)
        slots = attention_slots(num_tokens, num_seqs, group, rows, slot_pad)
        if num_splits is None:
            num_splits = choose_num_splits(slots * num_kv_heads, max_num_blocks * block_size,
                                           _sm_count(k_cache.device))
        if num_splits > 65535:
            raise ValueError(f"num_splits {num_splits} is over 65535")
        dtype = k_cache.dtype
        np = _numpy()
        device = k_cache.device
        fn = _function(device, ATTENTION_SOURCE, attention_kernel_name(dtype, head_dim, rows))
        smem = attention_shared_bytes(head_dim, block_size, rows)
        num_rows = num_tokens * num_heads
        if num_splits > 1:
            part_acc = torch.empty((num_splits, num_rows, head_dim), dtype=torch.float32, device=device)
            part_max = torch.empty((num_splits, num_rows), dtype=torch.float32, device=device)
            part_sum = torch.empty((num_splits, num_rows), dtype=torch.float32, device=device)
        else:
            part_acc = part_max = part_sum = torch.empty((1,), dtype=torch.float32, device=device)
        scale_log2 = float(scale) * math.log2(math.e)
        with _Launch(device) as L:
            fn((slots, num_kv_heads, num_splits), (ATTENTION_THREADS,),
               (L.arr(out), L.arr(part_acc), L.arr(part_max), L.arr(part_sum), L.arr(query),
                L.arr(k_cache), L.arr(v_cache), L.arr(block_tables), L.arr(context_lens),
                L.arr(query_start_loc), np.float32(scale_log2), np.int32(num_seqs),
                np.int32(num_tokens), np.int32(num_heads), np.int32(num_kv_heads),
                np.int32(block_size), np.int32(max_num_blocks), np.int32(num_splits),
                np.int32(slot_pad)),
               shared_mem=smem)
            if num_splits > 1:
                red = _function(device, ATTENTION_SOURCE, reduce_kernel_name(dtype))
                red((num_rows,), (128,),
                    (L.arr(out), L.arr(part_acc), L.arr(part_max), L.arr(part_sum),
                     np.int64(num_rows), np.int32(head_dim), np.int32(num_splits)))
        return out

    def copy_blocks(self, k_caches: torch.Tensor, v_caches: torch.Tensor,
                    block_mapping: torch.Tensor) -> None:
        """k_caches, v_caches ``[num_layers, num_blocks, num_kv_heads, block_size,
        head_dim]``; block_mapping int64 ``[num_pairs, 2]`` of (src, dst)."""
        checks.check_copy_blocks(k_caches, v_caches, block_mapping)
        _require_cuda("k_caches", k_caches)
        num_pairs = block_mapping.shape[0]
        num_layers, num_blocks, num_kv_heads, block_size, head_dim = k_caches.shape
        if num_pairs == 0 or num_layers == 0:
            return
        if num_layers > 65535:
            raise ValueError(f"k_caches: {num_layers} layers is over 65535")
        block_bytes = num_kv_heads * block_size * head_dim * k_caches.element_size()
        unit = copy_unit(block_bytes, k_caches, v_caches)
        fn = _function(k_caches.device, CACHE_OPS_SOURCE, copy_blocks_kernel_name(unit))
        np = _numpy()
        with _Launch(k_caches.device) as L:
            fn((num_pairs, num_layers), (256,),
               (L.arr(k_caches), L.arr(v_caches), L.arr(block_mapping), np.int64(num_blocks),
                np.int64(block_bytes // unit)))


def _numpy():
    import numpy
    return numpy

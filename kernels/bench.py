"""Decode benchmark of the CUDA paged-attention kernel (needs a CUDA device).

    python -m kernels.bench [--quick]

For each configuration (batch x context, GQA group, block size, dtype) it builds a
scattered paged KV pool (shuffled block table), times ``paged_attention`` with CUDA
events (warm-up, then the median of repeats) and reports:

- GB/s: bytes over time, bytes = K/V actually read (every sequence's context, all KV
  heads) + Q read + O written;
- % of 4.8 TB/s (the H200 datasheet) and % of a device-to-device copy measured in the
  same run (bytes read + written);
- the ratio to torch's ``scaled_dot_product_attention`` over the same K/V laid out
  contiguously (``sdpa ms / paged ms``: above 1, the paged kernel is faster), and the
  largest difference between the two outputs;
- the ratio to FlashInfer's paged decode on the same pool (``flashinfer ms / paged ms``)
  where the ``flashinfer-python`` package imports (the column says why not otherwise);
- the kernels' own time from ``torch.profiler`` (CUPTI), as a cross-check of the events.

What keeps the figures honest:

- **No host time in the timed region.** Before each timed launch the stream runs a GPU
  sleep (``torch.cuda._sleep``, ~1 ms) queued ahead of the start event: the host's work
  for the launch (argument checks, DLPack conversions, ~150 us) happens while the GPU
  sleeps, so the start event fires with the kernel already queued behind it.
- **A cold L2 that writes nothing back.** Before each timed launch the stream *reads* a
  buffer twice the L2's size (a sum): the L2 then holds none of the K/V, and no dirty
  lines drain to HBM during the timed kernel (filling a buffer would leave ~60 MB of
  them).

The grid is kept small (about a minute on an H200 after compilation); a configuration
that fails prints its error in its row and the run goes on. The table is printed last.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import traceback

import torch

DATASHEET_BPS = 4.8e12
HEAD_DIM = 128
NUM_HEADS = 32
#: GPU clock cycles of the sleep queued before each timed launch (~1 ms at 2 GHz).
SLEEP_CYCLES = 2_000_000


def cold_l2(flush: torch.Tensor) -> None:
    """Evicts the L2 by reading ``flush`` (twice the L2's size): nothing is left dirty."""
    flush.sum(dtype=torch.int64)


def _median_ms(fn, flush: torch.Tensor, warmup: int = 3, repeats: int = 15) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        cold_l2(flush)                       # (outside the timed region)
        torch.cuda._sleep(SLEEP_CYCLES)      # the GPU busy while the host prepares the launch
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def profiled_ms(fn, flush: torch.Tensor, match: str, repeats: int = 5) -> float:
    """The mean per call of the summed time of the CUDA kernels whose name contains
    ``match``, as ``torch.profiler`` (CUPTI) records them over ``repeats`` calls (each
    after an L2 eviction): the events' cross-check."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            cold_l2(flush)
            fn()
        torch.cuda.synchronize()
    us = sum(getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
             for e in prof.key_averages() if match in e.key)
    return us / 1e3 / repeats


def flashinfer_runner(query, k_cache, v_cache, block_tables, context, scale):
    """FlashInfer's paged decode over the same pool (HND layout, as ours), or the reason
    it cannot run here (a string)."""
    try:
        import flashinfer
    except Exception as exc:  # noqa: BLE001 - any import failure is a reason
        return f"flashinfer not importable ({type(exc).__name__})"
    try:
        batch, blocks_per_seq = block_tables.shape
        _, num_kv_heads, block_size, head_dim = k_cache.shape
        dev = query.device
        workspace = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, kv_layout="HND")
        indptr = torch.arange(batch + 1, dtype=torch.int32, device=dev) * blocks_per_seq
        last = torch.full((batch,), context - (blocks_per_seq - 1) * block_size, dtype=torch.int32, device=dev)
        wrapper.plan(indptr, block_tables.reshape(-1), last, query.shape[1], num_kv_heads, head_dim, block_size,
                     q_data_type=query.dtype, kv_data_type=k_cache.dtype, sm_scale=scale)
        run = lambda: wrapper.run(query, (k_cache, v_cache))  # noqa: E731
        run()
        return run
    except Exception as exc:  # noqa: BLE001 - reported in the column
        return f"flashinfer failed ({type(exc).__name__}: {str(exc).splitlines()[0][:60] if str(exc) else ''})"


def copy_bandwidth(flush: torch.Tensor) -> float:
    """Device-to-device copy, bytes read + written per second (1 GiB each way)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").fill_(3)
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src), flush, repeats=10)
    return 2 * (1 << 30) / (ms * 1e-3)


def bench_one(backend, *, batch: int, context: int, group: int, block_size: int,
              dtype: torch.dtype, num_splits: int | None, flush: torch.Tensor,
              copy_bps: float) -> dict:
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    gen = torch.Generator(device="cuda").manual_seed(batch * 7 + context + group)
    num_kv_heads = NUM_HEADS // group
    blocks_per_seq = math.ceil(context / block_size)
    num_blocks = batch * blocks_per_seq + 1
    shape = (num_blocks, num_kv_heads, block_size, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen, device="cuda", dtype=dtype)
    v_cache = torch.randn(shape, generator=gen, device="cuda", dtype=dtype)
    perm = torch.randperm(num_blocks - 1, generator=gen, device="cuda").to(torch.int32)
    block_tables = perm.view(batch, blocks_per_seq).contiguous()
    context_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    query = torch.randn((batch, NUM_HEADS, HEAD_DIM), generator=gen, device="cuda", dtype=dtype)
    scale = HEAD_DIM ** -0.5

    def run():
        return backend.paged_attention(query, k_cache, v_cache, block_tables, context_lens,
                                       query_start_loc, scale, num_splits=num_splits)

    ms = _median_ms(run, flush)
    prof_ms = profiled_ms(run, flush, "paged_attention")
    fi = flashinfer_runner(query, k_cache, v_cache, block_tables, context, scale)
    fi_ratio, fi_note = (None, fi) if isinstance(fi, str) else (_median_ms(fi, flush) / ms, "")
    fi = None
    ours = run().float()
    esize = k_cache.element_size()
    nbytes = (2 * batch * context * num_kv_heads * HEAD_DIM + 2 * batch * NUM_HEADS * HEAD_DIM) * esize
    bps = nbytes / (ms * 1e-3)

    # The same K/V, contiguous: [batch, kv_heads, context, D].
    ids = block_tables.long()
    k = k_cache[ids].permute(0, 2, 1, 3, 4).reshape(batch, num_kv_heads, -1, HEAD_DIM)[:, :, :context]
    v = v_cache[ids].permute(0, 2, 1, 3, 4).reshape(batch, num_kv_heads, -1, HEAD_DIM)[:, :, :context]
    k, v = k.contiguous(), v.contiguous()
    k_cache = v_cache = run = None      # (the paged pool's memory back before the copy is timed)
    q = query.view(batch, NUM_HEADS, 1, HEAD_DIM)

    def run_sdpa():
        return sdpa(q, k, v, scale=scale, enable_gqa=group > 1)

    diff = (ours - run_sdpa().view(batch, NUM_HEADS, HEAD_DIM).float()).abs().max().item()
    sdpa_ms = _median_ms(run_sdpa, flush)
    return {"ms": ms, "prof_ms": prof_ms, "GB/s": bps / 1e9, "%4.8TB/s": 100 * bps / DATASHEET_BPS,
            "%copy": 100 * bps / copy_bps, "sdpa_ratio": sdpa_ms / ms, "flashinfer_ratio": fi_ratio,
            "flashinfer_note": fi_note, "maxdiff": diff}


def configurations(quick: bool) -> list[dict]:
    """(batch, context, group, block size, dtype, splits): decode only, head_dim 128,
    32 query heads. Small on purpose: the whole GPU check must stay under 5 minutes."""
    rows = []
    for dtype in (torch.bfloat16, torch.float16):
        for batch, context in ((8, 4096), (64, 2048)):
            for group in (1, 4, 8):
                rows.append(dict(batch=batch, context=context, group=group, block_size=16,
                                 dtype=dtype, num_splits=None))
        if quick:
            break
    for bs in (32, 64, 128):
        rows.append(dict(batch=32, context=4096, group=8, block_size=bs, dtype=torch.bfloat16,
                         num_splits=None))
    for group in (8, 1):  # batch 1, 32k context: split-K (heuristic), and without
        rows.append(dict(batch=1, context=32768, group=group, block_size=16,
                         dtype=torch.bfloat16, num_splits=None))
    rows.append(dict(batch=1, context=32768, group=8, block_size=16, dtype=torch.bfloat16,
                     num_splits=1))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="decode benchmark of the CUDA paged attention")
    parser.add_argument("--quick", action="store_true", help="bf16 rows only")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 1
    import cupy

    from kernels import nvrtc_check
    from kernels.cuda_backend import CudaBackend

    props = torch.cuda.get_device_properties(0)
    print(f"device: {props.name}, {props.multi_processor_count} SMs, "
          f"{props.total_memory / 2**30:.0f} GiB, L2 {getattr(props, 'L2_cache_size', 0) / 2**20:.0f} MiB")
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), cupy {cupy.__version__}, "
          f"CUDA runtime {cupy.cuda.runtime.runtimeGetVersion()}, driver {cupy.cuda.runtime.driverGetVersion()}, "
          f"NVRTC {'.'.join(map(str, nvrtc_check.nvrtc_version()))}")
    # Twice the L2 (read before each timed launch), at least 64 MiB.
    l2 = getattr(props, "L2_cache_size", 0) or (60 << 20)
    flush = torch.ones(max(2 * l2, 64 << 20) // 8 * 8, dtype=torch.uint8, device="cuda")
    copy_bps = copy_bandwidth(flush)
    print(f"device-to-device copy: {copy_bps / 1e9:.0f} GB/s (read + write)")
    backend = CudaBackend()
    header = (f"{'dtype':5s} {'batch':>5s} {'ctx':>6s} {'grp':>3s} {'bs':>4s} {'splits':>6s} "
              f"{'ms':>8s} {'prof ms':>8s} {'GB/s':>7s} {'%4.8T':>6s} {'%copy':>6s} {'sdpa/x':>7s} "
              f"{'fi/x':>6s} {'maxdiff':>8s}")
    lines, notes = [], set()
    for cfg in configurations(args.quick):
        name = {torch.bfloat16: "bf16", torch.float16: "fp16"}[cfg["dtype"]]
        splits = "auto" if cfg["num_splits"] is None else str(cfg["num_splits"])
        lead = (f"{name:5s} {cfg['batch']:5d} {cfg['context']:6d} {cfg['group']:3d} "
                f"{cfg['block_size']:4d} {splits:>6s} ")
        try:
            r = bench_one(backend, flush=flush, copy_bps=copy_bps, **cfg)
            fi = "n/a" if r["flashinfer_ratio"] is None else f"{r['flashinfer_ratio']:.2f}"
            notes.add(r["flashinfer_note"])
            line = lead + (f"{r['ms']:8.3f} {r['prof_ms']:8.3f} {r['GB/s']:7.0f} {r['%4.8TB/s']:6.1f} "
                           f"{r['%copy']:6.1f} {r['sdpa_ratio']:7.2f} {fi:>6s} {r['maxdiff']:8.2e}")
        except Exception as exc:  # one failing row must not stop the table
            traceback.print_exc()
            line = lead + f"ERROR {type(exc).__name__}: {str(exc).splitlines()[0][:80] if str(exc) else ''}"
        print(line, flush=True)
        lines.append(line)
        torch.cuda.empty_cache()
    print()
    print("decode, head_dim 128, 32 query heads; GB/s = (K/V read + Q + O) / median time (CUDA events, a GPU")
    print("sleep ahead of each launch, L2 evicted by a read); prof ms = the kernels' time in torch.profiler;")
    print("sdpa/x = torch scaled_dot_product_attention time on contiguous K/V over ours; fi/x = FlashInfer's")
    print("paged decode time over ours" + "".join(f"; {n}" for n in sorted(notes) if n))
    print(header)
    for line in lines:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())

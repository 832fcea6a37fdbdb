"""Parallel sampling on the real allocator: how much memory sharing the prompt saves.

One request with a long prompt asks for ``n`` samples. Paged with sharing, the prompt is
created once and forked: the children share its blocks, the allocator copies a shared
partial last block when a sample first writes into it, and every sample then grows its
own blocks. Without sharing, ``n`` independent sequences each hold the whole prompt.

``parallel_sampling`` runs both cases through the SDK in local mode, each on a fresh pool
(one ``Client.step`` per simulated step, applied locally; after each step whose block
tables grew, ``Client.flush()`` and the allocator's count), records the peak of each
pool's used blocks as the allocator reports them, and compares the shared peak with the
least possible and with the unshared count::

    minimum     = prompt // bs + n * ceil((prompt % bs + output) / bs)
    independent = n * ceil((prompt + output) / bs)

The minimum counts the prompt's full blocks once and, per sample, the blocks of its own
tokens, including its copy of a partial last prompt block.
"""

from __future__ import annotations

import math
import time
import uuid

from kvservice.client import Client
from kvservice.simulate.workload import SimRequest, output_token, prompt_tokens


def parallel_sampling(target: str, *, prompt_len: int = 2000, n: int = 4, output_len: int = 338,
                      block_size: int = 16, seed: int = 0) -> dict:
    """Runs one ``n``-sample request shared and unshared; measures the physical blocks.

    Args:
        target: the allocator's ``host:port``.
        prompt_len: prompt tokens.
        n: samples (>= 1); shared: ``n - 1`` children forked from the prompt's sequence.
        output_len: tokens each sample generates (>= 1); shared, the first ones are
            appended in the fork's step; then one per sample per step.
        block_size: tokens per block (a power of two in 1..256).
        seed: seeds the prompt's token ids.

    Returns:
        ``physical_blocks`` (peak used blocks of the shared run), ``minimum_blocks``,
        ``independent_blocks`` (the unshared count, from the formula),
        ``independent_measured`` (the unshared run's peak), ``saving`` (``1 - physical /
        independent``), ``cow_copies``, ``steps``, ``flushes`` (of the shared run: after
        its fork step and after each step whose block tables grew, each followed by a read
        of the allocator's count),
        ``sample_tokens``, ``audit_ok`` (both pools),
        ``num_used_blocks`` (both pools, at the end), ``seconds`` and the inputs.

    Raises:
        ValueError: an argument out of range.
    """
    if prompt_len < 1 or output_len < 1 or n < 1:
        raise ValueError("prompt_len, output_len and n must be >= 1")
    if block_size < 1 or block_size > 256 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two in 1..256, got {block_size}")
    started = time.perf_counter()
    bs = block_size
    minimum = prompt_len // bs + n * math.ceil((prompt_len % bs + output_len) / bs)
    independent = n * math.ceil((prompt_len + output_len) / bs)
    req = SimRequest(0, 0, prompt_len, output_len, n)
    with Client(target, tenant=f"sim-{uuid.uuid4().hex[:12]}", lease_ttl=60.0, local=True) as client:
        shared = _run(client, req, seed, bs, independent + n, fork=True)
        alone = _run(client, req, seed, bs, independent + n, fork=False)
    return {
        "prompt_len": prompt_len, "n": n, "output_len": output_len, "block_size": bs,
        "physical_blocks": shared["peak"], "minimum_blocks": minimum, "independent_blocks": independent,
        "independent_measured": alone["peak"], "saving": 1 - shared["peak"] / independent,
        "cow_copies": shared["copies"], "steps": shared["steps"], "flushes": shared["flushes"],
        "sample_tokens": shared["tokens"], "audit_ok": shared["audit_ok"] and alone["audit_ok"],
        "num_used_blocks": shared["left"] + alone["left"], "seconds": time.perf_counter() - started,
    }


def _run(client: Client, req: SimRequest, seed: int, bs: int, num_blocks: int, *, fork: bool) -> dict:
    """One request's samples on a fresh pool: forked from one create, or ``n`` creates
    with distinct ``extra_key`` (so the prefix cache shares nothing)."""
    pool = f"sim-sampling-{'shared' if fork else 'alone'}-{uuid.uuid4().hex[:8]}"
    client.register_pool(pool, num_blocks=num_blocks, block_size=bs)
    prompt, p, n = prompt_tokens(req, seed), req.prompt_len, req.n
    first = [output_token(0, i, p) for i in range(n)]
    if fork:
        parent = client.step(creates=[(prompt, pool, b"")]).created[0]
        peak = client.pool_stats(pool).num_used_blocks
        res = client.step({parent: [first[0]]}, forks={parent: [[t] for t in first[1:]]} if n > 1 else None)
        samples = [parent, *res.children.get(parent.id, [])]
    else:
        samples = client.step(creates=[(prompt, pool, b"%d" % i) for i in range(n)]).created
        peak = client.pool_stats(pool).num_used_blocks
        res = client.step({s: [first[i]] for i, s in enumerate(samples)})
    copies = len(res.copies)

    def used() -> int:   # the allocator's count, once it has applied the local changes
        client.flush()
        return client.pool_stats(pool).num_used_blocks

    peak = max(peak, used())
    steps, flushes = 2, 1
    blocks = sum(len(s.block_table) for s in samples)
    for pos in range(p + 1, p + req.output_len):
        res = client.step({s: [output_token(0, i, pos)] for i, s in enumerate(samples)})
        copies += len(res.copies)
        steps += 1
        grown = sum(len(s.block_table) for s in samples)
        if grown != blocks:
            blocks, flushes = grown, flushes + 1
            peak = max(peak, used())
    tokens = [s.num_tokens for s in samples]
    client.step(frees=samples)
    client.flush()
    return {"peak": int(peak), "copies": copies, "steps": steps, "flushes": flushes, "tokens": tokens,
            "audit_ok": bool(client.audit(pool).ok), "left": int(client.pool_stats(pool).num_used_blocks)}

"""Synthetic request traces for the KV memory simulator.

A trace is a list of ``SimRequest``: when a request arrives (a step number), how long its
prompt is, how many tokens it generates, how many parallel samples it asks for and how
many of its leading prompt tokens are common to the whole workload (a system prompt).

Lengths are lognormal: for a preset mean ``m`` and shape ``sigma`` the draw is
``exp(N(ln m - sigma**2 / 2, sigma))``, whose mean is ``m`` before clipping. Each draw is
rounded and clipped so that ``prompt >= 1``, ``output >= 1`` and ``prompt + output <=
max_len``. At ``max_len = 2048`` this lowers the ShareGPT means by about 2% (prompt,
157 instead of 161 over 200,000 draws) and 1% (output, 334); the others not measurably.
Arrivals are a Poisson process of ``rate`` requests per step (exponential gaps).

Token ids (needed only where the allocator hashes prompts) are a pure function of the
seed, the request id, the sample and the position: the shared prefix is identical
across the requests of one seed, everything else differs between requests.

Example::

    reqs = generate("sharegpt", 2000, seed=0, rate=1.0)
    print(summary(reqs))   # {'requests': 2000, 'mean_prompt': ..., 'mean_output': ...}
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

#: Token ids are drawn from ``0 .. VOCAB - 1``.
VOCAB = 32000


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One request of a trace.

    Attributes:
        id: unique within the trace (also seeds its token ids).
        arrival: the step at which it joins the queue.
        prompt_len: prompt tokens (``shared_prefix`` of them common to the workload).
        output_len: tokens generated per sample.
        n: parallel samples (each generates ``output_len`` tokens after the prompt).
        shared_prefix: leading prompt tokens common to every request of the workload.
    """

    id: int
    arrival: int
    prompt_len: int
    output_len: int
    n: int = 1
    shared_prefix: int = 0

    @property
    def final_len(self) -> int:
        """Tokens one sample holds at its end: prompt plus output."""
        return self.prompt_len + self.output_len


@dataclass(frozen=True, slots=True)
class Preset:
    """The length distribution of a workload.

    Attributes:
        name: the preset's name (``--workload``).
        input_mean: mean prompt length, before clipping (the user part when
            ``shared_prefix`` is set: the prompt is the prefix plus this draw).
        input_sigma: lognormal shape of the prompt (or user part) length.
        output_mean: mean output length, before clipping.
        output_sigma: lognormal shape of the output length.
        n: parallel samples per request.
        shared_prefix: tokens of the system prompt common to every request (0: none).
        rate: a default arrival rate (requests per step) that keeps a 32,768-token pool
            saturated under every policy, so that most steps are in the measured regime.
        description: one line for reports.
    """

    name: str
    input_mean: float
    input_sigma: float
    output_mean: float
    output_sigma: float
    n: int = 1
    shared_prefix: int = 0
    rate: float = 1.0
    description: str = ""


#: The workloads. ShareGPT and Alpaca means are those of the vLLM paper (SOSP'23). The
#: ShareGPT sigmas (1.2 in, 0.7 out) are chosen so that the mean length of a live request
#: (length-weighted: long requests stay longer) gives the paper's ``max`` baseline, about
#: 20% of a 2,048-token reservation; the Alpaca ones are a plausible spread, not fitted.
PRESETS: dict[str, Preset] = {
    "sharegpt": Preset("sharegpt", 161, 1.2, 338, 0.7, rate=1.0,
                       description="ShareGPT-like chat: long outputs (means 161 in / 338 out)"),
    "alpaca": Preset("alpaca", 19, 0.7, 58, 0.8, rate=8.0,
                     description="Alpaca-like instructions: short (means 19 in / 58 out)"),
    "parallel": Preset("parallel", 161, 1.2, 338, 0.7, n=4, rate=0.5,
                       description="ShareGPT lengths, 4 parallel samples per request"),
    "system-prompt": Preset("system-prompt", 19, 0.7, 58, 0.8, shared_prefix=384, rate=8.0,
                            description="a 384-token system prompt shared by all, Alpaca-like user parts"),
}


def _lognormal(rng: random.Random, mean: float, sigma: float) -> float:
    if sigma <= 0:
        return float(mean)
    return rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)


def generate(preset: str, num_requests: int, *, seed: int, rate: float,
             max_len: int = 2048) -> list[SimRequest]:
    """A trace of ``num_requests`` requests drawn from a preset.

    Args:
        preset: a key of ``PRESETS``.
        num_requests: how many requests (>= 0).
        seed: seeds every draw (``random.Random(seed)``); equal seeds give equal traces.
        rate: mean arrivals per step (> 0); gaps are exponential, arrival steps are the
            floor of the arrival times, the first request arrives at step 0.
        max_len: the model's maximum length: ``prompt + output <= max_len``.

    Returns:
        The requests, ordered by arrival (ids ``0 .. num_requests - 1``).

    Raises:
        ValueError: an unknown preset or an argument out of range.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown workload preset {preset!r}; choose from {', '.join(PRESETS)}")
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if not rate > 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    p = PRESETS[preset]
    if max_len < p.shared_prefix + 2:
        raise ValueError(f"max_len {max_len} leaves no room after the {p.shared_prefix}-token shared prefix")
    rng = random.Random(seed)
    now = 0.0
    out: list[SimRequest] = []
    for i in range(num_requests):
        if i:
            now += rng.expovariate(rate)
        user = max(1, round(_lognormal(rng, p.input_mean, p.input_sigma)))
        prompt = min(p.shared_prefix + user, max_len - 1)
        output = max(1, round(_lognormal(rng, p.output_mean, p.output_sigma)))
        output = min(output, max_len - prompt)
        out.append(SimRequest(i, int(now), prompt, output, p.n, p.shared_prefix))
    return out


def summary(requests: list[SimRequest]) -> dict:
    """Counts and mean lengths of a trace (for reports and checks)."""
    k = len(requests) or 1
    return {
        "requests": len(requests),
        "mean_prompt": sum(r.prompt_len for r in requests) / k,
        "mean_output": sum(r.output_len for r in requests) / k,
        "max_final": max((r.final_len for r in requests), default=0),
        "last_arrival": requests[-1].arrival if requests else 0,
    }


def prompt_tokens(req: SimRequest, seed: int) -> list[int]:
    """The prompt's token ids: the shared prefix depends on the seed only.

    Args:
        req: the request.
        seed: the trace's seed.

    Returns:
        ``req.prompt_len`` token ids in ``0 .. VOCAB - 1``.
    """
    shared = min(req.shared_prefix, req.prompt_len)
    head = random.Random(f"kvservice-sim:{seed}:prefix")
    own = random.Random(f"kvservice-sim:{seed}:{req.id}")
    return ([head.randrange(VOCAB) for _ in range(shared)]
            + [own.randrange(VOCAB) for _ in range(req.prompt_len - shared)])


def output_token(req_id: int, sample: int, position: int) -> int:
    """The token id that sample ``sample`` of request ``req_id`` holds at ``position``.

    Cheap (it runs for every generated token) and distinct across samples, so the full
    output blocks of two samples never hash alike.
    """
    return (req_id * 7919 + sample * 104729 + position * 31) % VOCAB


def tokens_so_far(req: SimRequest, seed: int, sample: int, num_tokens: int) -> list[int]:
    """The first ``num_tokens`` token ids of one sample: its prompt, then its output."""
    toks = prompt_tokens(req, seed)[:num_tokens]
    toks += [output_token(req.id, sample, pos) for pos in range(len(toks), num_tokens)]
    return toks

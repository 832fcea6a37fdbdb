"""A real model on the worker: Forward over real gRPC against transformers' own forward
and generate (prefill, batched decode, chunked prefill, copy-on-write forks, seeded
sampling), bad Forward requests, and the model's settings.

Tolerance: Forward's float32 logits equal transformers' ``model(input_ids).logits[:, -1]`` (its
``LlamaForCausalLM`` with the worker's weights) within
``atol = rtol = 1e-4`` (paged online-softmax attention sums in another order than
transformers' attention; the differences seen are a few 1e-6). Greedy tokens and whole
greedy generations must be equal exactly.
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Callable

import grpc
import pytest
import torch
from worker_helpers import WorkerThread, model_shape, transformers_twin

from kvservice.v1 import worker_pb2 as pb
from kvservice.v1 import worker_pb2_grpc as pb_grpc
from worker import tensors
from worker.cli import build_parser
from worker.config import MODEL_NAMES, WorkerSettings
from worker.model import (
    MODEL_PRESETS,
    ModelRunner,
    StepSequence,
    build_model,
    sampling_seed,
)
from worker.pool import KVPool, PoolShape
from worker.server import build_pool
from worker.weights import PRETRAINED

BS, NUM_BLOCKS, SEED = 16, 256, 0
IA, FP = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION
ATOL = RTOL = 1e-4
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model():
    """The worker's model; the reference is transformers' twin of it (``_twin``)."""
    return build_model("tiny-llama", SEED)


_twin = functools.cache(transformers_twin)


@pytest.fixture(scope="module")
def worker(model):
    with WorkerThread(model_shape(model, NUM_BLOCKS, BS), model=model, model_name="tiny-llama",
                      model_seed=SEED) as w:
        yield w


@pytest.fixture(scope="module")
def stub(worker):
    with grpc.insecure_channel(worker.target) as channel:
        yield pb_grpc.WorkerStub(channel)


class Blocks:
    """Hands out the pool's block ids in a shuffled order, so block tables are scattered."""

    def __init__(self) -> None:
        self.free = list(range(NUM_BLOCKS))
        random.Random(1).shuffle(self.free)

    def take(self) -> int:
        if not self.free:
            self.__init__()
        return self.free.pop()


BLOCKS = Blocks()


def slots_of(table: list[int], start: int, end: int) -> list[int]:
    return [table[p // BS] * BS + p % BS for p in range(start, end)]


def prompt_of(n: int, salt: int = 0) -> list[int]:
    rng = random.Random(n * 7919 + salt)
    return [rng.randrange(512) for _ in range(n)]


class Seq:
    """A sequence as a client keeps it: its tokens, block table and cached length."""

    def __init__(self, tokens: list[int], temperature: float = 0.0, seed: int = 0,
                 table: list[int] | None = None, cached: int = 0) -> None:
        self.tokens, self.temperature, self.seed = list(tokens), temperature, seed
        self.table, self.cached, self.end = list(table or []), cached, 0

    def request(self, upto: int | None = None) -> pb.ForwardSequence:
        """The uncached tokens up to ``upto`` (default: all) as one ForwardSequence."""
        self.end = len(self.tokens) if upto is None else upto
        while len(self.table) < math.ceil(self.end / BS):
            self.table.append(BLOCKS.take())
        return pb.ForwardSequence(token_ids=self.tokens[self.cached:self.end], start_position=self.cached,
                                  block_table=self.table, slot_mapping=slots_of(self.table, self.cached, self.end),
                                  sampling=pb.SamplingParams(temperature=self.temperature, seed=self.seed))

    def accept(self, token: int) -> None:
        if self.end == len(self.tokens):
            self.tokens.append(token)
        self.cached = self.end


def forward(stub, seqs: list[Seq], copies=(), upto: dict[int, int] | None = None) -> torch.Tensor:
    """One Forward of ``seqs`` (their uncached tokens); appends the next tokens and
    returns the logits ``[len(seqs), vocab]``."""
    upto = upto or {}
    request = pb.ForwardRequest(epoch=1, return_logits=True, copies=[pb.BlockCopy(src=a, dst=b) for a, b in copies],
                                sequences=[s.request(upto.get(i)) for i, s in enumerate(seqs)])
    reply = stub.Forward(request, timeout=30)
    assert len(reply.next_tokens) == len(seqs)
    for s, token in zip(seqs, reply.next_tokens):
        s.accept(token)
    return tensors.decode(reply.logits, "logits", torch.float32, CPU)


def last_logits(model, tokens: list[int]) -> torch.Tensor:
    """transformers' logits of the last token (its twin of ``model``)."""
    with torch.inference_mode():
        return _twin(model)(torch.tensor([tokens])).logits[0, -1]


def generate(model, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy generation (its twin of ``model``)."""
    with torch.inference_mode():
        out = _twin(model).generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
    return out[0].tolist()


# ------------------------------------------------------------------ against transformers


@pytest.mark.parametrize("length", [1, 5, 16, 17, 40, 100])
def test_prefill_logits_and_greedy_token_match_transformers(model, stub, length):
    seq = Seq(prompt_of(length))
    got = forward(stub, [seq])
    assert got.shape == (1, 512) and got.dtype == torch.float32
    expected = last_logits(model, seq.tokens[:length])
    torch.testing.assert_close(got[0], expected, atol=ATOL, rtol=RTOL)
    assert seq.tokens[-1] == int(expected.argmax())


def test_batched_decode_reproduces_generate_with_mixed_prefill(model, stub):
    steps = 12
    seqs = [Seq(prompt_of(n, 1)) for n in (5, 17, 40)]
    late = Seq(prompt_of(23, 1))                 # joins at step 3: prefill and decode in one call
    forward(stub, seqs)
    for step in range(steps):
        if step == 3:
            seqs.insert(1, late)
        forward(stub, seqs)
    for s in seqs:
        prompt_len = 23 if s is late else len(s.tokens) - steps - 1
        assert s.tokens == generate(model, s.tokens[:prompt_len], len(s.tokens) - prompt_len)


def test_chunked_prefill_gives_the_same_logits(model, stub):
    prompt = prompt_of(40, 2)
    whole, chunked = Seq(prompt), Seq(prompt)
    expected = forward(stub, [whole])
    first = forward(stub, [chunked], upto={0: 23})
    torch.testing.assert_close(first[0], last_logits(model, prompt[:23]), atol=ATOL, rtol=RTOL)
    assert chunked.tokens == prompt and chunked.cached == 23
    second = forward(stub, [chunked])
    torch.testing.assert_close(second, expected, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(second[0], last_logits(model, prompt), atol=ATOL, rtol=RTOL)
    assert chunked.tokens == whole.tokens


def test_forked_child_generates_what_an_independent_sequence_does(model, worker, stub):
    prompt = prompt_of(20, 3)                    # two blocks, the second one partly filled
    parent = Seq(prompt)
    forward(stub, [parent])
    shared = parent.table[-1]
    kept = worker.pool.k_caches[:, shared, :, :4].clone()
    # The child shares the full block and gets a copy of the partly filled one, and
    # continues with another token than the parent's.
    other = (parent.tokens[-1] + 1) % 512
    child = Seq(prompt + [other], table=parent.table[:-1] + [BLOCKS.take()], cached=len(prompt))
    copies = [(shared, child.table[-1])]
    steps = 8
    forward(stub, [parent, child], copies=copies)
    for _ in range(steps - 1):
        forward(stub, [child, parent])
    assert parent.tokens == generate(model, prompt, steps + 1)
    assert child.tokens == generate(model, prompt + [other], steps)
    assert torch.equal(worker.pool.k_caches[:, shared, :, :4], kept)      # the parent's K is untouched
    # Sampled: a child with seed s draws what an independent sequence with seed s draws.
    parent = Seq(prompt, temperature=1.0, seed=5)
    forward(stub, [parent])
    child = Seq(list(parent.tokens), temperature=1.0, seed=6, table=parent.table[:-1] + [BLOCKS.take()],
                cached=len(prompt))
    alone = Seq(list(parent.tokens), temperature=1.0, seed=6)
    forward(stub, [parent, child], copies=[(parent.table[-1], child.table[-1])])
    for _ in range(steps - 1):
        forward(stub, [child, parent])
    for _ in range(steps):
        forward(stub, [alone])
    assert child.tokens == alone.tokens


def test_sampling_does_not_depend_on_the_batch(model, stub):
    def run(batched: bool, seed: int = 7) -> list[int]:
        seq = Seq(prompt_of(9, 4), temperature=1.0, seed=seed)
        others = [Seq(prompt_of(30, 4), temperature=0.7, seed=3), Seq(prompt_of(3, 4))]
        for step in range(10):
            batch = [seq]
            if batched:
                batch = [others[0], seq] if step < 4 else [others[1], seq, others[0]]
            forward(stub, batch)
        return seq.tokens

    alone = run(False)
    assert run(True) == alone
    assert run(False, seed=8) != alone
    greedy = Seq(prompt_of(9, 4))
    for _ in range(10):
        forward(stub, [greedy])
    assert greedy.tokens != alone
    # The first draw follows the documented formula.
    first = Seq(prompt_of(9, 4), temperature=1.0, seed=7)
    logits = forward(stub, [first])[0]
    gen = torch.Generator().manual_seed((7 * 1_000_003 + 9) % 2**63)
    expected = torch.multinomial(torch.softmax(logits.double() / 1.0, -1), 1, generator=gen)
    assert first.tokens[-1] == int(expected) == alone[9]


def test_extra_samples_draw_what_independent_sequences_would(stub):
    """n samples' first tokens from one prefill equal n separate prefills with those seeds."""
    prompt = prompt_of(21, 5)
    seeds = [11, 12, 13, 14]
    alone = []
    for seed in seeds:
        seq = Seq(prompt, temperature=0.9, seed=seed)
        forward(stub, [seq])
        alone.append(seq.tokens[-1])
    assert len(set(alone)) > 1
    seq = Seq(prompt, temperature=0.9, seed=seeds[0])
    req = seq.request()
    req.extra_samples.extend(pb.SamplingParams(temperature=0.9, seed=s) for s in seeds[1:])
    other = Seq(prompt_of(7, 5), temperature=0.5, seed=3)
    reply = stub.Forward(pb.ForwardRequest(epoch=1, sequences=[other.request(), req]), timeout=30)
    assert [reply.next_tokens[1], *reply.extra_tokens] == alone
    greedy = seq.request()
    greedy.extra_samples.add(temperature=0.0)
    again = stub.Forward(pb.ForwardRequest(epoch=1, sequences=[greedy], return_logits=True), timeout=30)
    logits = tensors.decode(again.logits, "logits", torch.float32, CPU)[0]
    assert list(again.extra_tokens) == [int(torch.argmax(logits))]


def test_describe_reports_the_model(stub):
    info = stub.Describe(pb.DescribeWorkerRequest())
    m = info.model
    assert (m.name, m.seed, m.vocab_size, m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim, m.hidden_size,
            m.dtype) == ("tiny-llama", SEED, 512, 2, 4, 2, 64, 256, "float32")
    assert m.source == "" and m.num_parameters == sum(p.numel() for p in build_model("tiny-llama", SEED).parameters())
    g = info.geometry
    assert (g.num_layers, g.num_kv_heads, g.head_dim, g.dtype, g.block_size) == (2, 2, 64, "float32", BS)


# ------------------------------------------------------------------ bad requests

TABLE = [3, 8]


def fseq(tokens=(1, 2), start: int = 0, table=TABLE, slots=None, temperature: float = 0.0, top_p: float = 0.0,
         top_k: int = 0) -> pb.ForwardSequence:
    slots = slots_of(list(table), start, start + len(tokens)) if slots is None else slots
    return pb.ForwardSequence(token_ids=list(tokens), start_position=start, block_table=list(table),
                              slot_mapping=list(slots),
                              sampling=pb.SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k))


def freq(*seqs: pb.ForwardSequence, copies=(), epoch: int = 1) -> pb.ForwardRequest:
    return pb.ForwardRequest(epoch=epoch, sequences=list(seqs) if seqs else [fseq()],
                             copies=[pb.BlockCopy(src=a, dst=b) for a, b in copies])


LAST = NUM_BLOCKS * BS
BAD: list[tuple[str, Callable[[], pb.ForwardRequest], grpc.StatusCode, str]] = [
    ("stale-epoch", lambda: freq(epoch=2), FP, "request for epoch 2, but pool w0 is at epoch 1"),
    ("no-sequence", lambda: pb.ForwardRequest(epoch=1), IA, "forward needs at least one sequence"),
    ("no-tokens", lambda: freq(fseq(), fseq(tokens=(), table=[5])), IA, "sequences[1] has no token_ids"),
    ("slot-count", lambda: freq(fseq(slots=[48])), IA, "sequences[0]: 1 slots in slot_mapping for 2 token_ids"),
    ("slot-out-of-range", lambda: freq(fseq(slots=[48, LAST])), IA,
     f"sequences[0].slot_mapping[1] = {LAST} is out of range 0..{LAST - 1}"),
    ("slot-negative", lambda: freq(fseq(slots=[-1, 49])), IA, "sequences[0].slot_mapping[0] = -1 is out of range"),
    ("slot-off-the-table", lambda: freq(fseq(slots=[48, 50])), IA,
     "sequences[0].slot_mapping[1] = 50, but position 1 is slot 49 of its block table"),
    ("slot-twice", lambda: freq(fseq(), fseq(tokens=(9,), start=1)), IA,
     "sequences[1].slot_mapping[0] = 49 is also sequences[0].slot_mapping[1]"),
    ("start-negative", lambda: freq(fseq(start=-1, slots=[0, 48])), IA, "sequences[0].start_position = -1"),
    ("beyond-table", lambda: freq(fseq(start=31, slots=[8 * BS + 15, 0])), IA,
     "sequences[0]: context of 33 tokens is beyond its block table of 2 blocks (32 slots)"),
    ("block-out-of-range", lambda: freq(fseq(start=16, table=[3, NUM_BLOCKS], slots=[0, 1])), IA,
     f"sequences[0].block_table[1] = {NUM_BLOCKS} is out of range 0..{NUM_BLOCKS - 1}"),
    ("block-negative", lambda: freq(fseq(table=[-4], slots=[0, 1])), IA, "sequences[0].block_table[0] = -4"),
    ("token-too-big", lambda: freq(fseq(tokens=(1, 512))), IA, "sequences[0].token_ids[1] = 512 is out of range 0..511"),
    ("token-negative", lambda: freq(fseq(tokens=(-1,))), IA, "sequences[0].token_ids[0] = -1 is out of range"),
    ("temperature-negative", lambda: freq(fseq(temperature=-0.5)), IA,
     "sequences[0].sampling.temperature must be finite and >= 0 (0: greedy), got -0.5"),
    ("temperature-nan", lambda: freq(fseq(temperature=float("nan"))), IA, "got nan"),
    ("temperature-inf", lambda: freq(fseq(temperature=float("inf"))), IA, "got inf"),
    ("top-p-above-1", lambda: freq(fseq(top_p=1.5)), IA, "sequences[0].sampling.top_p must be in [0, 1] (0 or 1: off), got 1.5"),
    ("top-k-negative", lambda: freq(fseq(top_k=-2)), IA, "sequences[0].sampling.top_k must be >= 0 (0: off), got -2"),
    ("copy-out-of-range", lambda: freq(copies=[(NUM_BLOCKS, 4)]), IA,
     f"copies[0].src = {NUM_BLOCKS} is out of range 0..{NUM_BLOCKS - 1}"),
    ("copy-dst-twice", lambda: freq(copies=[(1, 4), (2, 4)]), IA, "copies[1].dst = 4 is the destination of two"),
    ("copy-dst-is-a-source", lambda: freq(copies=[(1, 4), (4, 6)]), IA, "copies[0].dst = 4 is also a source"),
    ("extra-temperature", lambda: freq(pb.ForwardSequence(
        token_ids=[1, 2], start_position=0, block_table=TABLE, slot_mapping=slots_of(TABLE, 0, 2),
        extra_samples=[pb.SamplingParams(temperature=1.0), pb.SamplingParams(temperature=-2.0)])), IA,
     "sequences[0].extra_samples[1].temperature must be finite and >= 0 (0: greedy), got -2.0"),
    # A valid copy with a bad sequence: the copy must not be applied either.
    ("good-copy-bad-sequence", lambda: freq(fseq(tokens=(1, 600)), copies=[(1, 3)]), IA, "token_ids[1] = 600"),
]


@pytest.mark.parametrize("name,build,code,message", BAD, ids=[b[0] for b in BAD])
def test_bad_forward_gets_its_status_and_leaves_the_pool_unchanged(worker, stub, name, build, code, message):
    pool = worker.pool
    pool.k_caches.copy_(torch.arange(pool.k_caches.numel(), dtype=torch.float32).view_as(pool.k_caches))
    pool.v_caches.copy_(-pool.k_caches)
    before = (pool.k_caches.clone(), pool.v_caches.clone())
    with pytest.raises(grpc.RpcError) as info:
        stub.Forward(build(), timeout=10)
    assert info.value.code() == code, info.value.details()
    assert message in info.value.details()
    assert torch.equal(pool.k_caches, before[0]) and torch.equal(pool.v_caches, before[1])


def test_a_worker_without_a_model_refuses_forward():
    with WorkerThread(PoolShape(8, BS, 2, 2, 64, torch.float32)) as w, grpc.insecure_channel(w.target) as channel:
        stub = pb_grpc.WorkerStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.Forward(freq(fseq(table=[3])), timeout=10)
        assert info.value.code() == FP
        assert "this worker serves no model (start it with --model)" in info.value.details()
        assert not stub.Describe(pb.DescribeWorkerRequest()).HasField("model")


# ------------------------------------------------------------------ runner, presets, settings


def test_runner_directly_and_geometry_checks(model):
    pool = KVPool(model_shape(model, 16, 8), CPU)
    runner = ModelRunner(model, pool)
    prompt = prompt_of(11, 5)
    table = [7, 2]
    result = runner.step([], [StepSequence(prompt, 0, table, [table[p // 8] * 8 + p % 8 for p in range(11)])])
    torch.testing.assert_close(result.logits[0], last_logits(model, prompt), atol=ATOL, rtol=RTOL)
    for bad in (PoolShape(16, 8, 3, 2, 64, torch.float32), PoolShape(16, 8, 2, 4, 64, torch.float32),
                PoolShape(16, 8, 2, 2, 128, torch.float32), PoolShape(16, 8, 2, 2, 64, torch.float16)):
        with pytest.raises(ValueError, match="does not fit the model"):
            ModelRunner(model, KVPool(bad, CPU))


def test_sampling_formula_and_tiny_temperatures():
    logits = torch.randn(2, 512, generator=torch.Generator().manual_seed(0))
    seqs = [StepSequence([1], 41, [0], [41], temperature=0.8, seed=-3),
            StepSequence([1], 41, [0], [41], temperature=1e-300, seed=1)]
    got = ModelRunner.sample(logits, seqs)
    assert sampling_seed(-3, 42) == (-3 * 1_000_003 + 42) % 2**63
    gen = torch.Generator().manual_seed(sampling_seed(-3, 42))
    assert got[0] == int(torch.multinomial(torch.softmax(logits[0].double() / 0.8, -1), 1, generator=gen))
    assert got[1] == int(logits[1].argmax())


def test_top_k_and_top_p_sample_only_from_the_kept_tokens():
    probs = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15], dtype=torch.float64)
    logits = probs.log().float().unsqueeze(0)
    kept = {}
    for top_p, top_k in ((1.0, 2), (0.69, 0), (0.75, 0), (0.9, 3), (1.0, 1)):
        seen = set()
        for seed in range(200):
            seen |= set(ModelRunner.sample(logits, [StepSequence([1], 0, [0], [0], 1.0, seed, top_p, top_k)]))
        kept[(top_p, top_k)] = seen
    assert kept[(1.0, 2)] == {1, 3}                 # the two most likely
    assert kept[(0.69, 0)] == {1, 3}                # 0.4 + 0.3 reaches 0.69
    assert kept[(0.75, 0)] == {1, 3, 4}             # ... 0.75 needs the third
    assert kept[(0.9, 3)] == {1, 3, 4}              # top-k bounds the nucleus
    assert kept[(1.0, 1)] == {1}                    # top-k 1 is greedy
    # the draw is the one of the renormalised kept distribution, seeded as ever
    got = ModelRunner.sample(logits, [StepSequence([1], 41, [0], [41], 1.0, 9, 1.0, 2)])
    gen = torch.Generator().manual_seed(sampling_seed(9, 42))
    want = torch.zeros(5, dtype=torch.float64)
    want[[1, 3]] = torch.softmax(logits[0].double(), -1)[[1, 3]]
    assert got == [int(torch.multinomial(want, 1, generator=gen))]


def test_build_model_is_deterministic_and_offline():
    a, b, c = build_model("tiny-llama", 3), build_model("tiny-llama", 3), build_model("tiny-llama", 4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.embed_tokens.weight"], sc["model.embed_tokens.weight"])
    assert a.config.initializer_range == 0.1 and a.dtype == torch.float32 and not a.training
    with pytest.raises(ValueError, match="unknown model 'gpt-17'"):
        build_model("gpt-17")
    assert tuple(MODEL_PRESETS) + tuple(PRETRAINED) == MODEL_NAMES


def test_settings_take_the_geometry_from_the_model(caplog):
    caplog.set_level("INFO", logger="worker.server")
    settings = WorkerSettings(model="tiny-llama", kv_memory="1MiB", num_layers=32, head_dim=128, dtype="bfloat16",
                              device="cpu", block_size=16)
    pool = build_pool(settings, build_model("tiny-llama"))
    s = pool.shape
    assert (s.num_layers, s.num_kv_heads, s.head_dim, s.dtype, s.block_size) == (2, 2, 64, torch.float32, 16)
    assert s.num_blocks == (1 << 20) // (2 * 2 * 16 * 2 * 64 * 4)
    assert "--num-layers 32 ignored" in caplog.text and "--dtype bfloat16 ignored" in caplog.text
    with pytest.raises(ValueError, match="model must be one of"):
        WorkerSettings(model="gpt-17")
    with pytest.raises(ValueError, match="model_seed"):
        WorkerSettings(model="tiny-llama", model_seed=-1)
    text = build_parser().format_help()
    assert "--model MODEL" in text and "--model-seed MODEL_SEED" in text

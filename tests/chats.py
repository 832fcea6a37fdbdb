"""Multi-turn chats for the engine tests (lower tiers, fetches): each turn's prompt is the
last one, its answer and a new question; every answer is checked against transformers'
greedy ``generate`` (tokens, and logits within ``ATOL``).

Over SmolLM2 (``SMOLLM2``) the chats are text, rendered by the model's chat template; over
a seeded preset (``TINY``: no tokenizer, a fraction of SmolLM2's compute, for the tests
of the mechanisms rather than of the model) the same texts become token ids, one per word
(``words``), so that prompts and turns have about SmolLM2's lengths in tokens."""

from __future__ import annotations

import hashlib
import os
import tempfile
import urllib.request
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from kvservice.engine import Engine, Request
from kvservice.engine.text import Message
from worker import weights

STEPS = 8
ATOL = 1e-3


@dataclass(frozen=True)
class ChatModel:
    """A worker preset the chats run on."""

    name: str
    #: Its block of 16 tokens on a worker: 2 (K, V) x layers x KV heads x 16 x head_dim x 4 bytes.
    block_bytes: int

    def reference(self):
        """transformers' model with the workers' weights."""
        if self.name in weights.PRETRAINED:
            return weights.load(self.name)
        from worker.model import build_model
        from worker_helpers import transformers_twin
        return transformers_twin(build_model(self.name, 0))

    def tier_gb(self, entries: int) -> str:
        """A tier size (``--host-tier-gb``, ``--disk-tier-gb``) of ``entries`` blocks."""
        return f"{entries * self.block_bytes / 1e9:.9f}"


SMOLLM2 = ChatModel("smollm2-135m", 2 * 30 * 3 * 16 * 64 * 4)
TINY = ChatModel("tiny-llama", 2 * 2 * 2 * 16 * 64 * 4)
NAME = SMOLLM2.name
BLOCK_BYTES = SMOLLM2.block_bytes
#: The token ids ``words`` gives (``TINY``'s vocabulary is 512): 0..3 mark the roles.
_WORD_IDS = range(4, 512)
SYSTEMS = ["You are a careful assistant for a public library. Answer in plain words, at most two sentences, and "
           "say so when you do not know. Never invent titles, authors or dates; suggest asking a librarian instead.",
           "You are a terse assistant for a bicycle repair shop. Give the one most likely cause and the one next "
           "step. Mention safety first when brakes or wheels are involved, and keep every answer short."]
QUESTIONS = ["What should I read after a long novel about the sea?", "Which tools do I need to fix a flat tyre?",
             "How do I find a book whose title I forgot?", "Why does my chain skip when I pedal hard?",
             "Can I renew a loan twice in a row?", "The brakes squeal in the rain; is that dangerous?",
             "Where are the old newspapers kept?", "How tight should the spokes of a rear wheel be?"]
FOLLOW_UPS = ["Thank you. And if that does not help at all, what would you suggest instead of it?",
              "Could you say that again in simpler words for a child of ten years?"]


def metric(url: str, name: str, **labels: str) -> float:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.split()[-1])
    return total


def greedy(reference, prompt: list[int], steps: int = STEPS) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy ``generate`` of ``prompt`` from scratch: its ``steps`` tokens and
    their logits ``[steps, vocab]``. Computed once per model, prompt and length in a test
    run: many tests ask for the same chats, so the answer is kept in the run's model cache
    ($KVSERVICE_MODEL_CACHE, one folder that every test process of the run shares; written
    to a temporary file and renamed, so a reader never sees half of one)."""
    model = (reference.config._name_or_path, reference.config.to_json_string(use_diff=False))
    key = hashlib.sha256(repr((model, steps, list(prompt))).encode()).hexdigest()
    folder = Path(os.environ.get("KVSERVICE_MODEL_CACHE") or tempfile.gettempdir()) / "greedy-references"
    path = folder / f"{key}.pt"
    if path.is_file():
        return torch.load(path)
    with torch.inference_mode():
        out = reference.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 do_sample=False, max_new_tokens=steps, eos_token_id=None, pad_token_id=2,
                                 output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    logits = torch.stack([x[0] for x in out.logits]).float()
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        torch.save((tokens, logits), f)
    os.replace(tmp, path)
    return tokens, logits


def assert_greedy(reference, prompt: list[int], completion) -> None:
    """``completion`` (of ``STEPS`` tokens, with logits) equals transformers' greedy
    ``generate`` of ``prompt``: its tokens, and its logits within ``ATOL``."""
    tokens, logits = greedy(reference, prompt)
    assert completion.outputs[0] == tokens, completion.request_id
    got = torch.tensor([list(row) for row in completion.logits[0]])
    torch.testing.assert_close(got, logits, atol=ATOL, rtol=0)


def turns(engine: Engine, reference, conversations: int, turns: int, check=None,
          pool: Callable[[int, int], str] | None = None, systems: list[str] = SYSTEMS) -> list:
    """Runs ``turns`` rounds of ``conversations`` chats (shared system prompts); each turn's
    prompt is the previous one, its answer and a new question. Every answer is checked
    against transformers' greedy ``generate``. ``pool(conversation, turn)``: the pool of
    that turn's request ("" or None: placed). Returns the reports."""
    tok = engine.tokenizer
    prompts = [chat_prompt(tok, systems[i % len(systems)], QUESTIONS[i % len(QUESTIONS)])
               for i in range(conversations)]
    reports = []
    for t in range(turns):
        if check is not None:
            check(t)
        report = engine.run([Request(p, max_new_tokens=STEPS, ignore_eos=True, request_id=f"c{i}t{t}",
                                     pool=pool(i, t) if pool else "")
                             for i, p in enumerate(prompts)])
        assert report.failed == 0
        for p, c in zip(prompts, report.completions):
            assert_greedy(reference, p, c)
        reports.append(report)
        follow = FOLLOW_UPS[t % len(FOLLOW_UPS)]
        asked = encode(tok, f"\nuser: {follow}\nassistant:")
        prompts = [p + c.outputs[0] + asked for p, c in zip(prompts, report.completions)]
    return reports


def words(text: str) -> list[int]:
    """``text`` as token ids for a seeded preset: one per 4 characters of each word (about
    as many as SmolLM2's tokenizer makes), the same word the same ids."""
    return [_WORD_IDS[zlib.crc32(f"{w}/{i}".encode()) % len(_WORD_IDS)]
            for w in text.split() for i in range(0, len(w), 4)]


def chat_prompt(tok, system: str, user: str) -> list[int]:
    """A chat's prompt: by the model's chat template, or (``tok`` None: a seeded preset)
    role marks 0, 1, 2 around ``words``."""
    if tok is None:
        return [0, *words(system), 1, *words(user), 2]
    return tok.chat_prompt([Message("system", system), Message("user", user)])


def encode(tok, text: str) -> list[int]:
    """``text``'s token ids: by the model's tokenizer, or (``tok`` None) ``words``."""
    return words(text) if tok is None else tok.encode(text)

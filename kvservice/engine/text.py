"""Text for the engine: a model's tokenizer, its chat template and incremental decoding.

The worker that serves a pretrained model sends its tokenizer with ``Describe``
(``include_tokenizer``): ``tokenizer.json`` for the ``tokenizers`` package, the Jinja chat
template, the end-of-sequence ids. The engine therefore speaks the text of whatever model
its workers serve, with no model files of its own (and without torch).

``Tokenizer.chat_prompt`` renders the template as transformers' ``apply_chat_template``
does (a sandboxed Jinja environment, ``trim_blocks`` and ``lstrip_blocks``) and encodes
the result without adding special tokens (the template writes them). ``Detokenizer``
turns a sample's tokens into text as they arrive: a token whose bytes end inside a UTF-8
character is held until the character is complete, and text that could be the start of a
stop string is held until it is known not to be one (``StopMatcher``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Sequence

#: The roles a chat message may have.
ROLES = ("system", "user", "assistant", "developer", "tool")


@dataclass(frozen=True, slots=True)
class Message:
    """One chat message."""

    role: str
    content: str


class Tokenizer:
    """A model's tokenizer, from the worker's ``TokenizerInfo``.

    Args:
        tokenizer_json: the ``tokenizers`` package's serialized tokenizer.
        chat_template: the Jinja chat template ("" if the model has none).
        eos_token_ids: the ids that end a sample.
        bos_token, eos_token: the special tokens the template may name.
    """

    def __init__(self, tokenizer_json: bytes, chat_template: str = "", eos_token_ids: Sequence[int] = (),
                 bos_token: str = "", eos_token: str = "") -> None:
        from tokenizers import Tokenizer as Backend

        self._backend = Backend.from_str(tokenizer_json.decode())
        self.chat_template = chat_template
        self.eos_token_ids = frozenset(int(i) for i in eos_token_ids)
        self.bos_token, self.eos_token = bos_token, eos_token
        self.vocab_size = self._backend.get_vocab_size(with_added_tokens=True)
        self._template = None
        #: Special tokens (never part of decoded text).
        self.special_ids = frozenset(i for i, t in self._backend.get_added_tokens_decoder().items() if t.special)

    @classmethod
    def from_info(cls, info) -> "Tokenizer":
        """From a ``worker_pb2.TokenizerInfo``."""
        return cls(info.tokenizer_json, info.chat_template, list(info.eos_token_ids), info.bos_token, info.eos_token)

    def encode(self, text: str) -> list[int]:
        """The token ids of ``text`` (with the tokenizer's own special tokens, if its
        post-processor adds any)."""
        return self._backend.encode(text, add_special_tokens=True).ids

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``, special tokens left out."""
        return self._backend.decode(list(ids), skip_special_tokens=True)

    def render_chat(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
        """The chat template applied to ``messages``.

        Raises:
            ValueError: the model has no chat template, or the template refused the
                messages (its ``raise_exception``), or it failed to render.
        """
        if not self.chat_template:
            raise ValueError("the model has no chat template: send a plain prompt to /v1/completions")
        if self._template is None:
            self._template = _compile(self.chat_template)
        try:
            return self._template.render(messages=[{"role": m.role, "content": m.content} for m in messages],
                                         add_generation_prompt=add_generation_prompt, bos_token=self.bos_token,
                                         eos_token=self.eos_token)
        except ValueError:
            raise
        except Exception as exc:   # a template error names what it tripped on
            raise ValueError(f"the chat template failed on these messages: {exc}") from exc

    def chat_prompt(self, messages: Sequence[Message]) -> list[int]:
        """The token ids of the rendered chat, ending with the assistant's turn."""
        return self._backend.encode(self.render_chat(messages), add_special_tokens=False).ids


def _compile(source: str):
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ValueError(f"the chat template refused the messages: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent, ensure_ascii=False)
    try:
        return env.from_string(source)
    except TemplateError as exc:
        raise ValueError(f"the model's chat template does not compile: {exc}") from exc


class Detokenizer:
    """A sample's text, token by token.

    ``add(token)`` returns the text the token completes. Decoding the ids since the last
    emitted boundary, and keeping a few tokens of context before it, gives the same text
    as decoding everything at once (byte-level BPE merges spaces and multi-byte
    characters across tokens), at a cost per token that does not grow with the sample.
    """

    __slots__ = ("tokenizer", "ids", "_prefix", "_read", "_before")

    def __init__(self, tokenizer: Tokenizer, context: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.ids = list(context[-4:])         # a little context: the first token's leading space
        self._prefix, self._read = 0, len(self.ids)
        self._before = tokenizer.decode(self.ids)   # the text of ids[_prefix:_read]

    def add(self, token: int) -> str:
        self.ids.append(token)
        after = self.tokenizer.decode(self.ids[self._prefix:])
        before = self._before
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""      # nothing new yet, or a character cut in its middle: wait for more bytes
        self._before = self.tokenizer.decode(self.ids[self._read:])
        self._prefix, self._read = self._read, len(self.ids)
        return after[len(before):]


class StopMatcher:
    """Finds caller-given stop strings in a sample's text as it grows.

    ``feed(delta)`` returns ``(text, stopped)``: the text that may be emitted now (the
    text is cut before a stop string when one appears; otherwise its last ``longest - 1``
    characters wait, since they could begin a stop string) and whether a stop string was
    found. ``flush()`` returns what was held when the sample ends for another reason.
    """

    __slots__ = ("stops", "_hold", "_text", "_emitted")

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self._text, self._emitted = "", 0

    def feed(self, delta: str) -> tuple[str, bool]:
        start = max(0, len(self._text) - self._hold)
        self._text += delta
        cut = min((i for i in (self._text.find(s, start) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            out, self._text = self._text[self._emitted:cut], self._text[:cut]
            self._emitted = cut
            return out, True
        end = max(self._emitted, len(self._text) - self._hold)
        out, self._emitted = self._text[self._emitted:end], end
        return out, False

    def flush(self) -> str:
        out, self._emitted = self._text[self._emitted:], len(self._text)
        return out

    @property
    def text(self) -> str:
        """The sample's text so far (cut before a stop string, if one was found)."""
        return self._text

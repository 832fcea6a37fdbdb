"""Which instance should take a prompt: the index's cached prefixes against the
instances' load (docs/integrations.md, "Routing by KV events").

For each instance ``i``::

    cost(i) = prompt_tokens - cached(i) + load_tokens * load(i)
    cached(i) = block_size * (1.0 * GPU + 0.5 * CPU + 0.25 * STORAGE blocks of the prompt's
                cached prefix there, each block counted once, in its best medium)
    load(i) = the requests this router sent to i in the last ``load_window`` seconds

The least cost wins; ties go to the least load, then the name. ``cached`` is what the
instance need not compute (a host or storage block must still be loaded: worth less than
one on the device); the load term spreads prompts that share a prefix once an instance's
queue costs more than the prefix saves. The reason of each choice is counted: ``cache``
(the winner caches part of the prompt), ``load`` (none caches any: the least loaded)."""

from __future__ import annotations

import collections
import dataclasses
import threading
import time

from kvservice.events.index import Index, Match


@dataclasses.dataclass(slots=True)
class Ranked:
    instance: str
    cost: float
    cached_tokens: float         # weighted by medium
    cached_blocks: int
    by_medium: dict[str, int]
    load: int


class Router:
    """Ranks the index's instances for a prompt and records where it sent each."""

    def __init__(self, index: Index, *, load_tokens: float = 16.0, load_window: float = 5.0) -> None:
        self.index = index
        self.load_tokens = load_tokens
        self.load_window = load_window
        self._sent: dict[str, collections.deque[float]] = collections.defaultdict(collections.deque)
        self._lock = threading.Lock()

    def load(self, instance: str, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        with self._lock:
            q = self._sent[instance]
            while q and q[0] < now - self.load_window:
                q.popleft()
            return len(q)

    def rank(self, token_ids: list[int], *, lora_name: str | None = None) -> list[Ranked]:
        """Every instance, cheapest first."""
        matches: dict[str, Match] = self.index.lookup(token_ids, lora_name=lora_name)
        now = time.monotonic()
        out = []
        for name, m in matches.items():
            load = self.load(name, now)
            cost = len(token_ids) - m.weighted_tokens + self.load_tokens * load
            out.append(Ranked(name, cost, m.weighted_tokens, m.blocks, dict(m.by_medium), load))
        out.sort(key=lambda r: (r.cost, r.load, r.instance))
        return out

    def route(self, token_ids: list[int], *, lora_name: str | None = None) -> tuple[list[Ranked], str]:
        """``rank``, and the first one taken as sent: (the ranking, the reason)."""
        ranked = self.rank(token_ids, lora_name=lora_name)
        if not ranked:
            return ranked, "none"
        best = ranked[0]
        with self._lock:
            self._sent[best.instance].append(time.monotonic())
        return ranked, "cache" if best.cached_blocks else "load"

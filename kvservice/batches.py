"""Steps with more items than one allocator call takes: ``StepBatches`` is the part of
``kvservice.client.Client`` that spreads such a step over several Step calls. The
allocator takes any sizes (a create, fork or free larger than one script call is carried
out in parts, server side: docs/allocator.md, "Big operations in bounded calls"), but a
Step carries at most ``max_items_per_call`` items (updates and creates) and
``max_forks_per_call`` children.

A step split so keeps one step's semantics: its frees first, then its forks (with their
parents' appends: the children share the state before them), then the other appends,
then its creates. The partial-result contract is a multi-pool step's: if a call is
refused, the calls before it stay applied, and the error's ``result`` holds their
copy-on-write pairs, children and created sequences (and its ``partial`` response has one
entry per create of the whole step).
"""

from __future__ import annotations

from kvservice import errors
from kvservice.sequence import StepResult
from kvservice.v1 import allocator_pb2 as pb

#: Items (sequences updated, creates) of one Step, and children it forks: the allocator's
#: max_items_per_call and max_forks_per_call, by default.
MAX_ITEMS = 128
MAX_FORKS = 128


class StepBatches:
    """``Client._split_step``: a step's items in groups that one Step takes each."""

    def _step_groups(self, appends: dict, forks: dict, frees: list, creates: list) -> list[tuple]:
        """The step as (appends, forks, frees, creates) groups, in the order they are sent;
        one group when it fits in one Step. In local mode appends, forks and frees make no
        Step of their own: only the creates are counted."""
        local = self.local
        if len(creates) <= MAX_ITEMS and (local or (
                len(appends) + len(forks) + len(frees) + len(creates) <= MAX_ITEMS
                and sum(len(c) for c in forks.values()) <= MAX_FORKS)):
            return [(appends, forks, frees, creates)]
        groups: list[tuple] = []
        if not local:
            for i in range(0, len(frees), MAX_ITEMS):
                groups.append(({}, {}, frees[i:i + MAX_ITEMS], []))
            # Forks (a parent's children MAX_FORKS a call), then every append: the children
            # share their parents' state before the appends, as in one step.
            group: dict = {}
            children = 0
            for s, kids in forks.items():
                for i in range(0, len(kids), MAX_FORKS):
                    part = kids[i:i + MAX_FORKS]
                    if group and (len(group) >= MAX_ITEMS or children + len(part) > MAX_FORKS or s in group):
                        groups.append(({}, group, [], []))
                        group, children = {}, 0
                    group[s] = part
                    children += len(part)
            if group:
                groups.append(({}, group, [], []))
            rest = list(appends)
            for i in range(0, len(rest), MAX_ITEMS):
                groups.append(({s: appends[s] for s in rest[i:i + MAX_ITEMS]}, {}, [], []))
            appends, forks, frees = {}, {}, []
        for i in range(0, max(len(creates), 1), MAX_ITEMS):
            groups.append((appends, forks, frees, creates[i:i + MAX_ITEMS]) if i == 0
                          else ({}, {}, [], creates[i:i + MAX_ITEMS]))
        return [g for g in groups if any(g)]

    def _split_step(self, groups: list[tuple]) -> StepResult:
        """Sends the groups in order; refused, the error's ``result`` holds everything made
        so far, and its ``partial`` a response whose ``created`` lines up with all the
        step's creates."""
        total = StepResult()
        states: list[pb.Sequence] = []
        for k, (appends, forks, frees, creates) in enumerate(groups):
            try:
                got = self.step(appends, forks=forks, frees=frees, creates=creates)
            except errors.KvsError as exc:
                result = exc.result if isinstance(exc.result, StepResult) else StepResult()
                result.copies = total.copies + list(result.copies)
                result.created = total.created + list(result.created)
                for parent, kids in result.children.items():
                    total.children.setdefault(parent, []).extend(kids)
                result.children = total.children
                exc.result = result
                partial = pb.StepResponse()
                if exc.partial is not None:
                    partial.CopyFrom(exc.partial)
                del partial.created[:]
                partial.created.extend(states)
                partial.created.extend(exc.partial.created if exc.partial is not None and exc.partial.created
                                        else [pb.Sequence() for _ in creates])
                partial.created.extend(pb.Sequence() for g in groups[k + 1:] for _ in g[3])
                exc.partial = partial
                raise
            total.copies += got.copies
            total.created += got.created
            for parent, kids in got.children.items():
                total.children.setdefault(parent, []).extend(kids)
            total.rpc = total.rpc or got.rpc
            states += [pb.Sequence(sequence_id=s.id) for s in got.created]
        return total

"""Steps larger than one allocator call takes: ``StepBatches`` is the part of
``kvservice.client.Client`` that spreads a step's creates and frees over several Step
calls when the allocator's per-call limits (docs/security.md, "Limits") would refuse them
in one. It works on the client's state and has no state of its own but a cache of the
pools' block sizes.
"""

from __future__ import annotations

from kvservice import errors
from kvservice.sequence import Sequence, StepResult
from kvservice.v1 import allocator_pb2 as pb

#: Blocks one Step's frees may release: the allocator's max_release_per_call, by default
#: (a step that frees more frees the rest in calls of its own first).
MAX_RELEASE = 512
#: The blocks of one Step's creates in all, and its items: the allocator's
#: max_blocks_per_call and max_items_per_call, by default (a step with more creates makes
#: the first ones in calls of their own).
MAX_CREATE_BLOCKS = 512
MAX_CREATES = 128


class StepBatches:
    """``Client._create_groups``, ``_step_in_groups``, ``_free_ahead``."""

    def _create_groups(self, creates: list) -> list[list]:
        """The creates in runs that one Step takes (MAX_CREATE_BLOCKS, MAX_CREATES), in order
        (the pools' block sizes are read only when the prompts' tokens could pass it)."""
        if len(creates) <= MAX_CREATES and sum(len(c[0]) for c in creates) <= MAX_CREATE_BLOCKS:
            return [creates]
        groups: list[list] = [[]]
        blocks = 0
        for c in creates:
            n = -(-len(c[0]) // self._block_size(c[1]))
            if groups[-1] and (blocks + n > MAX_CREATE_BLOCKS or len(groups[-1]) >= MAX_CREATES):
                groups.append([])
                blocks = 0
            groups[-1].append(c)
            blocks += n
        return groups

    def _block_size(self, pool: str) -> int:
        """A pool's block size (any pool's smallest for a create without one), cached."""
        if pool not in self._block_sizes:
            sizes = {p.pool_id: p.geometry.block_size for p in self.pools()}
            sizes[""] = min(sizes.values(), default=1)
            self._block_sizes = sizes
        return self._block_sizes.get(pool) or self._block_sizes[""]

    def _step_in_groups(self, appends: dict, forks: dict, frees: list, groups: list[list]) -> StepResult:
        """A step whose creates one Step does not take: the first runs of creates in steps
        of their own, the last with the rest of the step. Refused, the error's ``result``
        holds every sequence made so far, and its ``partial`` a response whose ``created``
        lines up with all the step's creates."""
        made: list[Sequence] = []
        states: list[pb.Sequence] = []
        for i, group in enumerate(groups):
            last = i == len(groups) - 1
            try:
                got = self.step(appends if last else None, forks=forks if last else None,
                                frees=frees if last else (), creates=group)
            except errors.KvsError as exc:
                result = exc.result if isinstance(exc.result, StepResult) else StepResult()
                result.created = made + list(result.created)
                exc.result = result
                partial = pb.StepResponse()
                if exc.partial is not None:
                    partial.CopyFrom(exc.partial)
                del partial.created[:]
                partial.created.extend(states)
                partial.created.extend(exc.partial.created if exc.partial is not None and exc.partial.created
                                        else [pb.Sequence() for _ in group])
                partial.created.extend(pb.Sequence() for g in groups[i + 1:] for _ in g)
                exc.partial = partial
                raise
            made += got.created
            states += [pb.Sequence(sequence_id=s.id) for s in got.created]
        got.created = made
        return got

    def _free_ahead(self, frees: list[Sequence]) -> list[Sequence]:
        """Frees what one Step may not release (the allocator's max_release_per_call) in
        calls of their own first; returns the frees left for the step."""
        group: list[Sequence] = []
        blocks = 0
        for s in frees:
            if group and blocks + len(s._table) > MAX_RELEASE:
                self._step_remote({}, {}, group, [])
                group, blocks = [], 0
            group.append(s)
            blocks += len(s._table)
        return group

"""The allocator's side of the journal: a Sync's entries checked and turned into what the
sync script takes (``scripts/sync.lua``).

Entries arrive in columns (``JournalEntries``); every check runs over whole columns in C
(``min``/``max``/``sum``/``array``) and only a column that fails one is walked in Python,
to name the first entry that is wrong. The hashes of the commits are computed here: the
script cannot, and the allocator never takes a client's word for a hash.
"""

from __future__ import annotations

from typing import Any

from kvservice import errors
from kvservice.allocator.domain import JournalColumns, ReserveRequest
from kvservice.common import hashing
from kvservice.common.geometry import Geometry

MAX_INT = 2**31 - 1
MAX_SEQUENCE = 10**15 - 1
GROW, COPY, COMMIT, FORK, FREE = 1, 2, 3, 4, 5
KIND_NAMES = {GROW: "GROW", COPY: "COPY", COMMIT: "COMMIT", FORK: "FORK", FREE: "FREE"}

_COLUMNS = ("kinds", "sequences", "num_tokens", "children", "num_blocks", "num_commits")


def journal_payload(j: JournalColumns | None, first_entry: int, pool_id: str, geo: Geometry,
                    max_blocks: int, max_forks: int = 256) -> dict[str, Any]:
    """The script's ``journal`` argument: the columns as they came, plus ``commits`` (the
    hex hash of every committed block, in order) and ``parents`` (the hex parent hash of
    each entry with commits). InvalidArgument names the first entry that is malformed."""
    if j is None or not len(j):
        if j is not None and any(getattr(j, c) for c in ("blocks", "commit_tokens", "parent_hashes", *_COLUMNS)):
            raise errors.InvalidArgument(f"pool {pool_id}: the journal's columns have different lengths "
                                         "(no kinds, but other columns)")
        return {"n": 0}
    n = len(j.kinds)
    lengths = {c: len(getattr(j, c)) for c in _COLUMNS}
    if set(lengths.values()) != {n}:
        raise errors.InvalidArgument(f"pool {pool_id}: the journal's columns have different lengths "
                                     f"({', '.join(f'{c} {k}' for c, k in lengths.items())})")
    if not 1 <= first_entry <= MAX_INT - n:
        raise errors.InvalidArgument(f"pool {pool_id}: first_entry {first_entry} is out of range "
                                     "(entries are numbered from 1)")

    def refuse(i: int, problem: str) -> errors.InvalidArgument:
        return errors.InvalidArgument(f"pool {pool_id}: journal entry {first_entry + i}: {problem}")

    kinds, seqs, toks, children = j.kinds, j.sequences, j.num_tokens, j.children
    nblocks, ncommits = j.num_blocks, j.num_commits
    if min(kinds) < GROW or max(kinds) > FREE:
        i = next(i for i, k in enumerate(kinds) if k not in KIND_NAMES)
        raise refuse(i, f"unknown kind {kinds[i]}")
    if min(seqs) < 1 or max(seqs) > MAX_SEQUENCE:
        i = next(i for i, s in enumerate(seqs) if not 1 <= s <= MAX_SEQUENCE)
        raise refuse(i, f"sequence {seqs[i]} is out of range")
    if min(toks) < 1 or max(toks) > MAX_INT:
        i = next(i for i, t in enumerate(toks) if not 1 <= t <= MAX_INT)
        raise refuse(i, f"num_tokens {toks[i]} is out of range")
    if min(nblocks) < 0 or sum(nblocks) != len(j.blocks):
        i = next((i for i, b in enumerate(nblocks) if b < 0), n - 1)
        raise refuse(i, f"num_blocks {nblocks[i]}: the entries' num_blocks must be >= 0 and add up to "
                        f"the {len(j.blocks)} blocks sent")
    if len(j.blocks) > max_blocks:
        raise errors.InvalidArgument(f"pool {pool_id}: more than {max_blocks} blocks in one call")
    forks = kinds.count(FORK)
    if forks > max_forks:
        raise errors.InvalidArgument(f"pool {pool_id}: {forks} fork entries in one call, at most {max_forks}")
    if j.blocks and (min(j.blocks) < 0 or max(j.blocks) >= geo.num_blocks):
        bad = next(b for b in j.blocks if not 0 <= b < geo.num_blocks)
        at, seen = 0, 0
        for at, k in enumerate(nblocks):
            if bad in j.blocks[seen:seen + k]:
                break
            seen += k
        raise refuse(at, f"block {bad} is outside 0..{geo.num_blocks - 1}")
    bs = geo.block_size
    committing = n - ncommits.count(0)
    if min(ncommits) < 0 or sum(ncommits) * bs != len(j.commit_tokens):
        i = next((i for i, c in enumerate(ncommits) if c < 0), n - 1)
        raise refuse(i, f"num_commits {ncommits[i]}: the entries' num_commits must be >= 0, and "
                        f"{bs} commit_tokens per commit ({len(j.commit_tokens)} sent)")
    if len(j.parent_hashes) != committing * hashing.HASH_BYTES:
        raise errors.InvalidArgument(f"pool {pool_id}: parent_hashes must hold {hashing.HASH_BYTES} bytes "
                                     f"per entry with commits ({committing}), got {len(j.parent_hashes)}")
    # What each kind may carry (a run of GROW entries, the usual one, carries anything but
    # a child: checked in C).
    if kinds.count(GROW) != n or any(children):
        for i, k in enumerate(kinds):
            if children[i] and k != FORK:
                raise refuse(i, "only FORK entries name a child")
            if k == GROW:
                continue
            if nblocks[i] and k != COPY:
                raise refuse(i, "only GROW and COPY entries carry blocks")
            if ncommits[i] and k != COMMIT:
                raise refuse(i, "only COMMIT and GROW entries carry commits")
            if k == COPY and nblocks[i] != 1:
                raise refuse(i, f"COPY carries one block, got {nblocks[i]}")
            if k == COMMIT and not ncommits[i]:
                raise refuse(i, "a commit needs at least one block")
            if k == FORK and not 1 <= children[i] <= MAX_SEQUENCE:
                raise refuse(i, f"child {children[i]} is out of range")
    commits: list[str] = []
    parents: list[str] = []
    if committing:
        at = next(i for i, c in enumerate(ncommits) if c)
        data = hashing.token_bytes_checked(j.commit_tokens, f"pool {pool_id}: journal entry {first_entry + at}")
        hb = hashing.HASH_BYTES
        ph = j.parent_hashes
        # Each committing entry's chain from its parent, in one pass; every hash is turned
        # to hex at once, then cut (a decode entry commits one block: this loop runs once
        # per block the journal commits).
        digests = hashing.chain_runs(ph, data, bs, [c for c in ncommits if c])
        parents = _hex_pieces(ph.hex(), 2 * hb)
        commits = _hex_pieces(b"".join(digests).hex(), 2 * hb)
    return {"n": n, "kinds": kinds, "sequences": seqs, "num_tokens": toks, "children": children,
            "num_blocks": nblocks, "blocks": j.blocks, "num_commits": ncommits, "commits": commits,
            "parents": parents}


def _hex_pieces(text: str, width: int) -> list[str]:
    return [text[i:i + width] for i in range(0, len(text), width)]


def resync_payload(r: ReserveRequest, geo: Geometry) -> list[dict[str, Any]]:
    """The resync script's ``claims`` (``scripts/resync.lua``) from a ``PoolResync``, each
    claim checked for shape (its blocks in the pool, a table that covers exactly its
    tokens, whole hashes); InvalidArgument names the first one that is not."""
    pool_id = r.pool_id
    if r.entries is not None and len(r.entries):
        raise errors.InvalidArgument(f"pool {pool_id}: a resync carries no journal entries")
    if r.returned_blocks or r.need_blocks:
        raise errors.InvalidArgument(f"pool {pool_id}: a resync returns no blocks and needs none")
    if not 1 <= r.first_entry <= MAX_INT:
        raise errors.InvalidArgument(f"pool {pool_id}: first_entry {r.first_entry} is out of range "
                                     "(entries are numbered from 1)")
    bs, hb = geo.block_size, hashing.HASH_BYTES
    claims, seen = [], set()
    for c in r.resync or ():
        what = f"pool {pool_id}: resync of sequence {c.sequence}"
        if not 1 <= c.sequence <= MAX_SEQUENCE:
            raise errors.InvalidArgument(f"pool {pool_id}: resync: sequence {c.sequence} is out of range")
        if c.sequence in seen:
            raise errors.InvalidArgument(f"{what}: the sequence is claimed twice")
        seen.add(c.sequence)
        if not 1 <= c.num_tokens <= MAX_INT:
            raise errors.InvalidArgument(f"{what}: num_tokens {c.num_tokens} is out of range")
        if len(c.block_table) != -(-c.num_tokens // bs):
            raise errors.InvalidArgument(f"{what}: {len(c.block_table)} blocks for {c.num_tokens} tokens "
                                         f"(blocks of {bs})")
        if min(c.block_table) < 0 or max(c.block_table) >= geo.num_blocks:
            bad = next(b for b in c.block_table if not 0 <= b < geo.num_blocks)
            raise errors.InvalidArgument(f"{what}: block {bad} is outside 0..{geo.num_blocks - 1}")
        if not 0 <= c.num_committed_blocks <= c.num_tokens // bs:
            raise errors.InvalidArgument(f"{what}: {c.num_committed_blocks} committed blocks, at most "
                                         f"{c.num_tokens // bs} are full")
        if len(c.block_hashes) != c.num_committed_blocks * hb or len(c.last_hash) != hb:
            raise errors.InvalidArgument(f"{what}: block_hashes must hold {hb} bytes per committed block "
                                         f"and last_hash {hb} bytes")
        if not 0 <= c.num_cached_tokens <= c.num_tokens:
            raise errors.InvalidArgument(f"{what}: num_cached_tokens {c.num_cached_tokens} is out of range")
        hs = c.block_hashes
        claims.append({"n": c.sequence, "t": c.num_tokens, "tab": list(c.block_table), "c": c.num_committed_blocks,
                       "h": c.last_hash.hex(), "hs": [hs[i:i + hb].hex() for i in range(0, len(hs), hb)],
                       "k": c.num_cached_tokens})
    return claims


#: One sync script call applies at most this many entries, and this much work: blocks
#: moved, commits, and the table blocks a fork shares or a free releases (each script
#: stalls Redis while it runs: about 40 µs per entry and a few per block, ~10 ms at most).
SCRIPT_ENTRIES = 128
SCRIPT_WORK = 1024
#: A resync's part (``scripts/resync.lua``) drops or checks about this many blocks.
RESYNC_WORK = 1024


def journal_chunks(journal: dict[str, Any], block_size: int, max_fork_refs: int = SCRIPT_WORK,
                   max_release: int = SCRIPT_WORK) -> list[tuple[int, dict[str, Any], bool]]:
    """A ``journal_payload`` cut into the script calls that apply it: (the offset of the
    call's first entry in the journal, its part of the columns, whether it is one long
    entry: a FORK of a sequence of more than ``max_fork_refs`` blocks or a FREE of more than
    ``max_release``, applied in parts); at least one call."""
    n = journal["n"]
    if n == 0:
        return [(0, journal, False)]
    kinds, toks, nb, nc = journal["kinds"], journal["num_tokens"], journal["num_blocks"], journal["num_commits"]
    cuts, work, forked, start = [], 0, 0, 0
    for i in range(n):
        k = kinds[i]
        table = -(-toks[i] // block_size) if k in (FORK, FREE) else 0
        if (k == FORK and table > max_fork_refs) or (k == FREE and table > max_release):
            if i > start:
                cuts.append((start, i, False))
            cuts.append((i, i + 1, True))
            start, work, forked = i + 1, 0, 0
            continue
        w = 1 + nb[i] + nc[i] + table
        refs = table if k == FORK else 0
        if i > start and (i - start >= SCRIPT_ENTRIES or work + w > SCRIPT_WORK or forked + refs > max_fork_refs):
            cuts.append((start, i, False))
            start, work, forked = i, 0, 0
        work += w
        forked += refs
    if start < n:
        cuts.append((start, n, False))
    if len(cuts) == 1 and not cuts[0][2]:
        return [(0, journal, False)]
    out = []
    bo = co = po = 0
    for a, b, big in cuts:
        kb, kc = sum(nb[a:b]), sum(nc[a:b])
        kp = sum(1 for c in nc[a:b] if c)
        out.append((a, {"n": b - a, "kinds": kinds[a:b], "sequences": journal["sequences"][a:b], "num_tokens": toks[a:b],
                        "children": journal["children"][a:b], "num_blocks": nb[a:b],
                        "blocks": journal["blocks"][bo:bo + kb], "num_commits": nc[a:b],
                        "commits": journal["commits"][co:co + kc], "parents": journal["parents"][po:po + kp]}, big))
        bo, co, po = bo + kb, co + kc, po + kp
    return out

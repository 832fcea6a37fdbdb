"""Operations larger than one script call (DESIGN §14), carried out in bounded parts.

The per-call bounds (``max_blocks_per_call``, ``max_release_per_call``,
``max_fork_refs_per_call``) keep every script call under ~10 ms of Redis; they are this
module's unit of work, never a ceiling for the caller. A create or a fork larger than one
call is a *run* (``scripts/stage.lua``, ``scripts/lib/runs.lua``): a staged record built
part after part, then made a sequence; a long sequence is freed from its last block, part
after part. A step whose work exceeds one call (the step script answers TOO_BIG before it
reads any table) is carried out in each pool as:

1. its lengths, commits and frees (frees of long sequences in parts): applied whatever
   becomes of the rest, as the SDK's local mode does (their blocks serve the rest);
2. its forks and its creates (when they hold more blocks than one call takes) staged as
   runs, held; growth larger than one call takes staged as runs too (new blocks only);
3. the rest in one step call (growth, grafting the staged new blocks; the staged
   children's own growth before their parents'; the small creates);
4. if that is refused, every staged run is given back (the pool is as after 1) and the
   caller hears the refusal; else the runs become sequences and the whole outcome is
   kept under the step's request id, as one call's would be.

A mixin of ``core.Allocator`` (its store, settings, geometry and lease attachment).
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
from typing import Any, NamedTuple

from kvservice import errors
from kvservice.allocator import events
from kvservice.allocator.codec import LEASE_UNKNOWN, RUN_SHORT, STALE_EPOCH, ScriptError, TOO_BIG
from kvservice.allocator.generations import known_generation
from kvservice.common import hashing

#: Hashes one probe call looks up. (A run's part does ``max_blocks_per_call`` blocks of
#: work, the same bound as a step's new blocks: ``kvservice limits`` measures the largest.)
PROBE_CHUNK = 2048


class Probe(NamedTuple):
    """A pool's answer to a prefix probe (``scripts/probe.lua``): leading blocks cached
    on the device, how many of them block tables reference, blocks available, sequences,
    milliseconds since its worker's last heartbeat (since it registered, if none yet),
    and (a probe through the tiers) the leading blocks cached on the device or ready in
    a lower tier, of which ``host`` / ``disk`` would be loaded from one."""

    hits: int
    referenced: int
    available: int
    sequences: int
    silent_ms: int
    chain: int = 0
    host: int = 0
    disk: int = 0


class RunOps:
    """Runs and steps in parts: ``_step_in_parts`` and the runs it is made of."""

    # ------------------------------------------------------------ probes

    async def _probe_prefix(self, pool_id: str, epoch: int, hashes: list[str], *, tiers: bool = False) -> Probe:
        """How much of a chain of hashes the pool caches from the start, in bounded calls;
        with ``tiers``, through its lower tiers' ready entries too (``Probe.chain``)."""
        hits = referenced = chain = host = disk = 0
        device_run = True       # (the device's leading hits go on into this slice)
        for i in range(0, max(len(hashes), 1), PROBE_CHUNK):
            part = hashes[i:i + PROBE_CHUNK]
            reply = await self.store.probe(pool_id, epoch, part, tiers=tiers)
            if device_run:
                hits += reply["hits"]
                referenced += reply["referenced"]
                device_run = reply["hits"] == len(part)
            chain += reply.get("chain", reply["hits"])
            host += reply.get("host", 0)
            disk += reply.get("disk", 0)
            if reply.get("chain", reply["hits"]) < len(part) or (not tiers and not device_run):
                break
        return Probe(hits, referenced, reply["available"], reply["sequences"], reply.get("silent_ms", 0),
                     chain, host, disk)

    # ------------------------------------------------------------ runs

    def _run_base(self, op: str, pool_id: str, epoch: int, lease_id: str, tenant: str, lease_left: int,
                  run_id: str, print_: str) -> dict[str, Any]:
        return {"op": op, "pool": pool_id, "epoch": epoch, "generation": known_generation(pool_id),
                "lease_id": lease_id, "lease_left_ms": lease_left,
                "tenant": tenant, "quota": self.quota(tenant), "request_id": run_id, "fingerprint": print_,
                "request_ttl_ms": self._request_ttl_ms(), "budget": self.settings.max_blocks_per_call,
                "sequence": 0, "hold": False, "defer": False,
                "num_tokens": 0, "root_hash": "", "expect": 0, "first": 1, "hashes": [], "parent": 0}

    async def _stage(self, payload: dict[str, Any]) -> dict[str, Any]:
        """One part (``scripts/stage.lua``); once more after attaching the lease again when
        the pool forgot it (re-registered since)."""
        for _ in range(3):
            try:
                return await self.store.stage(payload)
            except ScriptError as exc:
                if exc.code == STALE_EPOCH:
                    raise errors.FailedPrecondition(f"pool {payload['pool']} was re-registered during the call",
                                                    reason="EPOCH_CHANGED") from None
                if exc.code != LEASE_UNKNOWN:
                    raise
                self._leases.pop(payload["lease_id"], None)
                _, payload["lease_left_ms"] = await self._attach(payload["lease_id"], [payload["pool"]])
        raise errors.Unavailable(f"pool {payload['pool']}: the lease could not be attached")

    async def _run(self, payload: dict[str, Any], next_first: Any = None) -> dict[str, Any]:
        """A create, grow or fork run to its end (``ready`` or ``done``): its parts one after
        the other (``next_first(reply)``: the ``first`` index of the next part's slice of
        hashes). Refused midway (for lack of blocks: the internal RUN_SHORT, raised as
        ResourceExhausted; past a quota; the pool re-registered), every block the run staged
        goes back before the error is raised. Returns the last reply, with ``block_table``
        (the run's blocks) and ``run`` (its sequence number)."""
        pool_id, lease_id, tenant = payload["pool"], payload["lease_id"], payload["tenant"]
        hashes = payload.pop("all_hashes", [])
        table: list[int] = []
        while True:
            try:
                reply = await self._stage(payload)
            except (errors.KvsError, ScriptError) as exc:
                # (the first call starts the run and may be refused in its first part: its
                # number is under the request key)
                n = payload["sequence"] or await self.store.run_number(pool_id, payload["request_id"])
                if n and not isinstance(exc, errors.LeaseExpired):
                    await self._free_in_parts(pool_id, lease_id, tenant, n, payload["request_id"],
                                              payload["fingerprint"])
                if isinstance(exc, ScriptError) and exc.code == RUN_SHORT:
                    raise errors.ResourceExhausted(
                        f"{exc.reply.get('message', 'out of blocks')}",
                        needed=int(exc.reply.get("needed", 0)), available=int(exc.reply.get("available", 0)),
                        pool_id=pool_id) from None
                raise
            payload["sequence"] = reply["sequence"]
            table.extend(reply["blocks"])
            if reply["done"] or reply["ready"]:
                break
            if next_first is not None:
                first = payload["first"] = next_first(reply)
                payload["hashes"] = hashes[first - 1:first - 1 + payload["budget"]]
        if len(table) != reply["num_blocks"]:     # (a run resumed: its first parts were another attempt's)
            table = await self.store.block_table(pool_id, reply["sequence"])
        return {**reply, "block_table": table, "run": reply["sequence"]}

    async def _create_in_parts(self, pool_id: str, lease_id: str, tenant: str, lease_left: int, data: bytes,
                               root: bytes, hashes: list[bytes], run_id: str, print_: str,
                               hold: bool, defer: bool = False) -> dict[str, Any]:
        """A create as a run: admitted, staged part after part, its new blocks' hashes
        registered (not with ``defer``: the client commits them once written), then
        (unless ``hold``) made a sequence. Returns the record (with its ``block_table``)."""
        epoch, geo = await self.geometry(pool_id)
        bs = geo.block_size
        num_tokens = len(data) // 4
        total = -(-num_tokens // bs)
        hs = [h.hex() for h in hashes]
        referenced = (await self._probe_prefix(pool_id, epoch, hs[:(num_tokens - 1) // bs])).referenced
        payload = self._run_base("create", pool_id, epoch, lease_id, tenant, lease_left, run_id, print_)
        payload.update(num_tokens=num_tokens, root_hash=root.hex(), expect=total - referenced, hold=hold, defer=defer,
                       hashes=hs[:self.settings.max_blocks_per_call], all_hashes=hs)

        def next_first(reply: dict[str, Any]) -> int:
            nb, c = reply["num_blocks"], reply["num_committed_blocks"]
            return nb + 1 if nb < total else c + 1

        return await self._run(payload, next_first)

    async def _fork_in_parts(self, pool_id: str, lease_id: str, tenant: str, lease_left: int, parent: int,
                             run_id: str, print_: str, hold: bool) -> dict[str, Any]:
        """A fork as a run: a staged child gets its parent's blocks part after part, then
        (unless ``hold``) becomes a sequence. Returns its record (with ``block_table``)."""
        epoch, _ = await self.geometry(pool_id)
        payload = self._run_base("fork", pool_id, epoch, lease_id, tenant, lease_left, run_id, print_)
        payload.update(parent=parent, hold=hold)
        return await self._run(payload)

    async def _grow_in_parts(self, pool_id: str, lease_id: str, tenant: str, lease_left: int, blocks: int,
                             run_id: str, print_: str) -> dict[str, Any]:
        """``blocks`` new blocks staged for a growth larger than one call (admitted first,
        then taken part after part); the step script grafts them onto the sequence."""
        epoch, geo = await self.geometry(pool_id)
        payload = self._run_base("grow", pool_id, epoch, lease_id, tenant, lease_left, run_id, print_)
        payload.update(num_tokens=blocks * geo.block_size, expect=blocks, hold=True)
        return await self._run(payload, lambda reply: reply["num_blocks"] + 1)

    async def _free_in_parts(self, pool_id: str, lease_id: str, tenant: str, n: int, run_id: str = "",
                             print_: str = "") -> dict[str, Any] | None:
        """Frees sequence ``n`` (live or staged: a run given back) from its last block, a
        part per call, until it is gone; None if it was gone already."""
        if not n:
            return None
        epoch, _ = await self.geometry(pool_id)
        payload = self._run_base("free", pool_id, epoch, lease_id, tenant, 0, run_id or "", print_)
        payload["sequence"] = n
        first = None
        while True:
            try:
                reply = await self._stage(payload)
            except errors.NotFound:
                return first
            first = first or reply
            if reply["done"]:
                return first

    async def _flip(self, pool_id: str, lease_id: str, tenant: str, n: int, run_id: str, print_: str) -> None:
        epoch, _ = await self.geometry(pool_id)
        payload = self._run_base("flip", pool_id, epoch, lease_id, tenant, 0, run_id, print_)
        payload["sequence"] = n
        await self._stage(payload)

    # ------------------------------------------------------------ a step in parts

    async def _step_in_parts(self, pool_id: str, items: dict[str, list], lease_id: str, tenant: str,
                             lease_left: int, request_id: str, digest: str,
                             details: dict[str, Any] | None) -> dict[str, Any]:
        """One pool's part of a step too big for one call (see the module's docstring);
        returns what the step script's reply would be. Runs to its end even if the caller
        goes away (a half-done step would hold staged blocks until the lease ends)."""
        return await asyncio.shield(self._step_in_parts_now(pool_id, items, lease_id, tenant, lease_left,
                                                            request_id, digest, details))

    async def _step_in_parts_now(self, pool_id: str, items: dict[str, list], lease_id: str, tenant: str,
                                 lease_left: int, request_id: str, digest: str,
                                 details: dict[str, Any] | None) -> dict[str, Any]:
        s = self.settings
        epoch, geo = await self.geometry(pool_id)
        rid = request_id or f"run.{secrets.token_hex(8)}"
        base = digest or hashlib.sha256(rid.encode()).hexdigest()

        def sub(tag: str) -> tuple[str, str]:
            """A part's own request id and fingerprint, derived from the step's."""
            return f"{rid}.{tag}", hashlib.sha256(f"{base}.{tag}".encode()).hexdigest()

        ups = [payload for _, _, payload in items["updates"]]
        if details is None:
            details = await self._measure(pool_id, items, lease_id, tenant, lease_left)
        free_blocks = {i - 1: nb for i, nb in details["frees"]}
        fork_blocks = {i - 1: nb for i, nb in details["forks"]}
        grows = {g[0] - 1: (g[1], g[2]) for g in details["grows"]}     # index -> (new blocks, partial last)
        long_frees = {i for i, nb in free_blocks.items() if nb > s.max_release_per_call}
        # (every fork of a step in parts is staged: its child's growth is then an update of
        # its own, whose new blocks may be staged too)
        stage_forks = bool(fork_blocks)
        create_blocks = sum(-(-(len(data) // 4) // geo.block_size) for _, _, data in items["creates"])
        stage_creates = create_blocks > s.max_blocks_per_call

        # Growth the pool cannot hold is refused first, before anything is applied.
        await self._check_room(pool_id, epoch, sum(more for more, _ in grows.values()))
        if self.settings.kv_events:      # (the tokens behind the hashes this step registers)
            records = dict(items.get("tokens", {}))
            for _, c, data in items["creates"]:
                root = hashing.root_hash(self._salt(tenant), c.extra_key)
                hs = hashing.chain_hashes(root, data, geo.block_size, len(data) // 4 // geo.block_size)
                records[events.tokens_key(root.hex())] = events.ROOT
                records.update(events.chain_records(root.hex(), [h.hex() for h in hs], data, geo.block_size))
            await events.note_tokens(self.store.redis, records)
        replies = await self._first_part(pool_id, ups, free_blocks, long_frees, lease_id, tenant, lease_left, sub)

        # 2. Large forks and creates, staged and held.
        staged: list[tuple[int, str, str]] = []      # (run sequence, run id, fingerprint)
        children: dict[int, list[dict[str, Any]]] = {}
        created: list[dict[str, Any]] = []
        try:
            if stage_forks:
                for i, u in enumerate(ups):
                    for j, _ in enumerate(u["fork_grow_to"]):
                        run_id, print_ = sub(f"k{i}.{j}")
                        rec = await self._fork_in_parts(pool_id, lease_id, tenant, lease_left, u["sequence"], run_id,
                                                        print_, hold=True)
                        staged.append((rec["run"], run_id, print_))
                        children.setdefault(i, []).append(rec)
            if stage_creates:
                items["hashes"] = []
                for j, (_, c, data) in enumerate(items["creates"]):
                    root = hashing.root_hash(self._salt(tenant), c.extra_key)
                    hs = hashing.chain_hashes(root, data, geo.block_size, len(data) // 4 // geo.block_size)
                    items["hashes"].append(hs)
                    run_id, print_ = sub(f"c{j}")
                    rec = await self._create_in_parts(pool_id, lease_id, tenant, lease_left, data, root, hs, run_id,
                                                      print_, hold=True, defer=c.defer_commits)
                    staged.append((rec["run"], run_id, print_))
                    created.append(rec)

            # 3. The rest, in one call: the staged children's growth before their parents'.
            rest: list[dict[str, Any]] = []
            where: list[tuple[str, int, int]] = []
            growth: list[tuple[int, int]] = []          # (new blocks, 1: a copy may be needed)
            bs = geo.block_size
            for i, u in enumerate(ups):
                if u["free"]:
                    continue
                for j, child in enumerate(children.get(i, [])):
                    g = u["fork_grow_to"][j]
                    if g > child["num_tokens"]:
                        rest.append({**u, "sequence": child["sequence"], "num_tokens": -1, "grow_to": g,
                                     "fork_grow_to": [], "commits": [], "num_committed_blocks": 0,
                                     "parent_hash": "", "free": False, "staged": True, "tag": ""})
                        where.append(("child", i, j))
                        # (a child shares its parent's partial last block: it copies it to write)
                        growth.append((max(0, -(-g // bs) - len(child["block_table"])),
                                       1 if child["num_tokens"] % bs else 0))
            for i, u in enumerate(ups):
                if u["free"]:
                    continue
                rest.append({**u, "commits": [], "num_committed_blocks": 0, "parent_hash": "",
                             "fork_grow_to": [] if stage_forks else u["fork_grow_to"]})
                where.append(("update", i, 0))
                growth.append(grows.get(i, (0, 0)) if u["grow_to"] else (0, 0))
            creates = [] if stage_creates else self._create_payloads(pool_id, items, tenant, epoch, geo)
            room = s.max_blocks_per_call - sum(-(-c["num_tokens"] // bs) for c in creates)
            needed = sum(more + partial for more, partial in growth)
            grafted: dict[int, list[int]] = {}
            if needed > room:
                # (growth larger than one call: its blocks, a copy-on-write destination first
                # where one may be needed, staged as grow runs and grafted)
                await self._check_room(pool_id, epoch, sum(more for more, _ in growth), always=True)
                for k, (u, (more, partial)) in enumerate(zip(rest, growth)):
                    if more + partial:
                        run_id, print_ = sub(f"g{k}")
                        x = await self._grow_in_parts(pool_id, lease_id, tenant, lease_left, more + partial, run_id,
                                                      print_)
                        staged.append((x["run"], run_id, print_))
                        u["graft"], u["graft_cow"] = x["run"], bool(partial)
                        grafted[k] = x["block_table"][partial:]
            last = None
            if rest or creates:
                last = await self._step_call(pool_id, rest, creates, lease_id, tenant, lease_left, *sub("b"))
        except BaseException as exc:
            # 4. Refused: the staged runs go back; the caller learns what 1. applied.
            for n, run_id, print_ in reversed(staged):
                await self._free_in_parts(pool_id, lease_id, tenant, n, run_id, print_)
            if isinstance(exc, errors.KvsError):
                exc.applied = dict(replies)
            raise
        # 4. The runs become sequences (the grow runs were grafted: gone).
        for n, run_id, print_ in staged:
            if n not in {u.get("graft") for u in rest}:
                await self._flip(pool_id, lease_id, tenant, n, run_id, print_)
        out_updates: list[dict[str, Any]] = [dict(replies.get(i, {})) for i in range(len(ups))]
        copies: list[Any] = []
        if last is not None:
            copies = list(last["copies"])
            for k, ((kind, i, j), d) in enumerate(zip(where, last["updates"])):
                if k in grafted:
                    d["new_blocks"] = list(d.get("new_blocks", [])) + grafted[k]
                if kind == "child":
                    child = children[i][j]
                    table = child["block_table"]
                    if d.get("cow"):
                        table[-1] = d["cow"][1]
                        child["cow"] = d["cow"]
                    table.extend(d.get("new_blocks", []))
                    child["num_tokens"] = d["num_tokens"]
                else:
                    out_updates[i] = {**out_updates[i], **d}
            if not stage_creates:
                created = list(last["created"])
        for i, kids in children.items():
            out_updates[i]["children"] = [_record(k) for k in kids]
        out = {"epoch": epoch, "updates": out_updates, "created": [_record(c) for c in created], "copies": copies,
               "tier_orders": list(last.get("tier_orders") or []) if last is not None else [],
               "generation": last["generation"] if last is not None else await self.store.generation(pool_id),
               # (the last script's, or read after it: the lease holds every block of the step by then)
               "serial": last["serial"] if last is not None and "serial" in last else await self.store.version(pool_id)}
        if request_id:
            await self.store.remember(pool_id, request_id, digest, out, self._request_ttl_ms())
        return out

    async def _check_room(self, pool_id: str, epoch: int, least: int, *, always: bool = False) -> None:
        """RESOURCE_EXHAUSTED when a step in parts needs more new blocks than the pool has
        (read only when they are more than one call takes, or ``always``), before any of
        them is staged."""
        if always or least > self.settings.max_blocks_per_call:
            available = (await self._probe_prefix(pool_id, epoch, [])).available
            if least > available:
                raise errors.ResourceExhausted(f"pool {pool_id}: needed {least} blocks, {available} available",
                                               needed=least, available=available, pool_id=pool_id)

    async def _first_part(self, pool_id: str, ups: list[dict[str, Any]], free_blocks: dict[int, int],
                          long_frees: set[int], lease_id: str, tenant: str, lease_left: int,
                          sub: Any) -> dict[int, dict[str, Any]]:
        """Step 1 of a step in parts: the commits, the lengths of forks' parents (one call
        applies them before its forks: a staged child copies its parent's length) and the
        frees, applied whatever becomes of the rest, in calls of at most
        max_blocks_per_call commits and max_release_per_call released blocks (a long list of
        commits in several; a long free in parts), one update of a sequence a call. Returns
        each such update's delta by its index; refused, the error's ``applied`` holds those
        applied before."""
        s = self.settings
        replies: dict[int, dict[str, Any]] = {}
        parts: list[tuple[int, int, dict[str, Any], int | None]] = []   # (commits, released, payload, index)
        m = s.max_blocks_per_call
        for i, u in enumerate(ups):
            commits = u["commits"]
            short_free = u["free"] and i not in long_frees
            if not (commits or u["free"] or u["fork_grow_to"]):
                continue           # (its length goes with the rest: only a fork's parent needs it first)
            chunks = [commits[k:k + m] for k in range(0, len(commits), m)] or [[]]
            for k, chunk in enumerate(chunks):
                last = k == len(chunks) - 1
                part = {**u, "free": False, "grow_to": 0, "fork_grow_to": [], "commits": chunk,
                        "num_committed_blocks": u["num_committed_blocks"] + k * m if chunk else 0,
                        "parent_hash": (commits[k * m - 1] if k else u["parent_hash"]) if chunk else ""}
                if last and short_free and len(chunks) == 1:
                    parts.append((len(chunk), free_blocks.get(i, 0), {**part, "free": True}, i))
                else:
                    parts.append((len(chunk), 0, part, i if last and not short_free else None))
            if short_free and len(chunks) > 1:
                parts.append((0, free_blocks.get(i, 0), {**u, "commits": [], "num_committed_blocks": 0,
                                                          "parent_hash": ""}, i))
        calls: list[list[tuple[dict[str, Any], int | None]]] = [[]]
        counts = [0, 0]
        for ncommits, released, payload, index in parts:
            here = {p["sequence"] for p, _ in calls[-1]}
            if calls[-1] and (counts[0] + ncommits > m or counts[1] + released > s.max_release_per_call
                              or payload["sequence"] in here):
                calls.append([])
                counts = [0, 0]
            calls[-1].append((payload, index))
            counts[0] += ncommits
            counts[1] += released
        try:
            for k, call in enumerate(calls):
                if not call:
                    continue
                reply = await self._step_call(pool_id, [p for p, _ in call], [], lease_id, tenant, lease_left,
                                              *sub(f"a{k}"))
                for (_, i), d in zip(call, reply["updates"]):
                    if i is not None:
                        replies[i] = d
            for i in sorted(long_frees):
                got = await self._free_in_parts(pool_id, lease_id, tenant, ups[i]["sequence"])
                d = dict(replies.get(i, {}))
                d.update(freed=True, children=[])
                if got is not None and "num_tokens" not in d:
                    d.update(num_tokens=got["num_tokens"], num_committed_blocks=got["num_committed_blocks"],
                             last_hash=got["last_hash"])
                replies[i] = d
        except errors.KvsError as exc:
            exc.applied = {i: d for i, d in replies.items() if not ups[i]["free"] or d.get("freed")}
            raise
        for i, u in enumerate(ups):
            if u["free"]:
                replies[i]["freed"] = True
        return replies


    async def _measure(self, pool_id: str, items: dict[str, list], lease_id: str,
                       tenant: str, lease_left: int) -> dict[str, Any]:
        """The sizes of a step's frees, forks and growth (a step whose creates alone were
        too big for one call): the step script's TOO_BIG answer to the updates alone, or
        none when they fit."""
        ups = [payload for _, _, payload in items["updates"]]
        if not ups:
            return {"frees": [], "forks": [], "grows": []}
        probe = self._step_payload(pool_id, ups, [], lease_id, tenant, lease_left, "", "")
        probe["max_release"] = probe["max_fork_refs"] = probe["max_blocks"] = -1     # (always TOO_BIG: a read)
        reply = (await self.store.step([probe]))[0]
        if isinstance(reply, ScriptError) and reply.code == TOO_BIG:
            return {k: reply.reply.get(k, []) for k in ("frees", "forks", "grows")}
        if isinstance(reply, Exception):
            raise reply
        raise RuntimeError("a step with no room to work was applied")

    async def _step_call(self, pool_id: str, updates: list[dict[str, Any]], creates: list[dict[str, Any]],
                         lease_id: str, tenant: str, lease_left: int, request_id: str,
                         print_: str) -> dict[str, Any]:
        """One step script call of a step in parts; its error raised."""
        payload = self._step_payload(pool_id, updates, creates, lease_id, tenant, lease_left, request_id, print_)
        reply = (await self.store.step([payload]))[0]
        if isinstance(reply, ScriptError):
            if reply.code == TOO_BIG:
                raise errors.InvalidArgument(f"pool {pool_id}: {reply.reply.get('message', 'too big')}")
            raise errors.Unavailable(f"pool {pool_id}: {reply.reply.get('message', reply.code)}")
        if isinstance(reply, Exception):
            raise reply
        return reply


def _record(rec: dict[str, Any]) -> dict[str, Any]:
    """A run's record as the step script's reply records are."""
    out = {"sequence": rec["sequence"], "num_tokens": rec["num_tokens"],
           "num_committed_blocks": rec["num_committed_blocks"], "num_cached_tokens": rec["num_cached_tokens"],
           "last_hash": rec["last_hash"], "block_table": rec["block_table"]}
    if rec.get("cow"):
        out["cow"] = rec["cow"]
    if rec.get("shared") is not None:
        out["shared"] = rec["shared"]
    return out

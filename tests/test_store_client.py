"""The KV store a connector uses (``kvservice.integrations.store``, DESIGN §15) against a
real secure stack with a store worker (K/V only, role store), no vLLM: a prompt held, its
blocks written then committed, held again and read back; two tenants; two writers of the
same prompt; the scheduler side's lease used by a side that has none; an instance that
dies leaves nothing held after its lease's TTL."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from kvservice import errors
from kvservice.integrations.store import KVStore
from kvservice.tools.launcher import Stack

BS = 4
GEOMETRY = ("--num-layers", "2", "--num-kv-heads", "1", "--head-dim", "8", "--dtype", "float32")
BPB = 2 * 2 * BS * 1 * 8 * 4           # bytes per block
PROMPT = list(range(1, 14))             # 3 full blocks and one token

pytestmark = [pytest.mark.timeout(180), pytest.mark.e2e]


@pytest.fixture(scope="module")
def stack():
    with Stack(1, model="", block_size=BS, num_blocks=32, worker_args=GEOMETRY, roles=("store",)) as s:
        yield s


def _store(stack: Stack, identity: str = "engine", **kw) -> KVStore:
    return KVStore(stack.target, credentials=stack.credentials(identity), extra_key=b"test", **kw)


def _blocks(n: int, seed: int) -> bytes:
    return bytes((seed * 31 + i * 7) % 251 for i in range(n * BPB))


def test_a_prompt_written_and_committed_is_held_again_and_read_back(stack):
    with_lease = _store(stack)
    try:
        held = with_lease.hold(PROMPT)
        assert held is not None and held.pool_id == "worker-0" and held.num_cached_tokens == 0
        assert with_lease.geometry(held) == (BS, BPB)
        data = _blocks(3, 1)
        assert with_lease.write(held, 0, PROMPT, data) == 3
        again = with_lease.hold(PROMPT + [99])
        assert again.num_cached_tokens == 12 and again.num_committed_blocks == 3
        assert bytes(with_lease.read(again, 0, 3)) == data
        with_lease.release(again)
        # another tenant's prompt of the same tokens shares nothing
        other = _store(stack, "api")
        try:
            theirs = other.hold(PROMPT)
            assert theirs.num_cached_tokens == 0 and not set(theirs.block_table) & set(again.block_table[:3])
            other.release(theirs)
        finally:
            other.close()
    finally:
        with_lease.close()
    assert stack.audit().ok


def test_the_side_without_a_lease_writes_on_the_holders_lease_and_a_failed_write_commits_nothing(stack):
    holder, writer = _store(stack), _store(stack, lease=False)
    try:
        prompt = [p + 100 for p in PROMPT]
        held = holder.hold(prompt)
        with pytest.raises(errors.InvalidArgument):          # (one block's bytes short)
            writer.write(held, 0, prompt, _blocks(3, 2)[:-1])
        assert holder.hold(prompt).num_cached_tokens == 0    # (nothing committed, the sequence let go)
        held = holder.hold(prompt)
        assert writer.write(held, 0, prompt, _blocks(3, 2)) == 3
        assert holder.hold(prompt).num_cached_tokens == 12
    finally:
        holder.close()
        writer.close()
    assert stack.audit().ok


def test_two_writers_of_one_prompt_both_commit_and_a_third_reads_it(stack):
    a, b = _store(stack), _store(stack)
    try:
        prompt = [p + 200 for p in PROMPT]
        ha, hb = a.hold(prompt), b.hold(prompt)
        assert ha.num_cached_tokens == hb.num_cached_tokens == 0      # (neither is written yet)
        data = _blocks(3, 3)
        assert a.write(ha, 0, prompt, data) == 3 and b.write(hb, 0, prompt, data) == 3
        hc = a.hold(prompt)
        assert hc.num_cached_tokens == 12 and bytes(a.read(hc, 0, 3)) == data
        a.release(hc)
    finally:
        a.close()
        b.close()
    assert stack.audit().ok


def test_an_instance_that_dies_leaves_nothing_held_after_its_ttl(stack):
    creds = stack.credentials("engine")
    code = (f"import os; from kvservice.integrations.store import KVStore; "
            f"s = KVStore({stack.target!r}, extra_key=b'test', lease_ttl=1.0); h = s.hold({[p + 300 for p in PROMPT]}); "
            f"print(len(h.block_table), flush=True); os._exit(0)")
    env = {**os.environ, "KVSERVICE_TLS_CA": creds.ca, "KVSERVICE_CLIENT_CERT": creds.cert,
           "KVSERVICE_CLIENT_KEY": creds.key}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "4", out.stderr
    deadline = time.monotonic() + 20
    while stack.audit("worker-0").pools[0].num_sequences:
        assert time.monotonic() < deadline, "the dead instance's sequence is still held"
        time.sleep(0.2)
    assert stack.audit().ok

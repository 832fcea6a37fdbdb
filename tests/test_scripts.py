"""The Lua scripts as files: headers, the include loader, error lines, the codec."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import redis

from kvservice.allocator import codec, lua
from kvservice.allocator.store import _explained

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", sorted(lua.SCRIPTS))
def test_every_script_header_names_each_key_and_argument_it_uses_and_its_reply(name):
    script = lua.SCRIPTS[name]
    header = script.header
    assert header.startswith(f"{name}: "), header[:80]
    assert "KEYS[" in header and "ARGV[1]" in header and "Returns" in header, header
    named: set[tuple[str, int]] = set()
    for kind, first, last in re.findall(r"(KEYS|ARGV)\[(\d+)(?:\.\.(\d+))?\]", header):
        named.update((kind, i) for i in range(int(first), int(last or first) + 1))
    used = {(kind, int(i)) for kind, i in re.findall(r"(KEYS|ARGV)\[(\d+)\]", script.source)}
    assert used and used <= named, f"used but not in the header: {sorted(used - named)}"


def test_the_registry_holds_every_script_file_and_no_helper():
    assert set(lua.SCRIPTS) == {p.stem for p in (ROOT / "kvservice/allocator/scripts").glob("*.lua")}
    assert "step" in lua.SCRIPTS and not any(n.startswith("lib") for n in lua.SCRIPTS)


def test_a_helper_is_included_once_and_only_where_used():
    step = lua.SCRIPTS["step"].source
    assert step.count("local function now_ms()") == 1
    assert step.count("local function args()") == 1          # lib/codec, included by three helpers
    assert "@include" not in step
    assert "local function now_ms()" in lua.SCRIPTS["probe"].source   # (a pool's silence: lib/time)
    assert "local function now_ms()" not in lua.SCRIPTS["place"].source
    assert "local function load_refs(" not in lua.SCRIPTS["probe"].source


def test_no_lua_left_in_python_files():
    for path in (ROOT / "kvservice").rglob("*.py"):
        text = path.read_text()
        assert "redis.call(" not in text and "cjson" not in text and "cmsgpack" not in text.replace(
            "``cmsgpack``", ""), path


def test_the_loader_refuses_an_include_cycle(tmp_path, monkeypatch):
    (tmp_path / "lib").mkdir()
    (tmp_path / "a.lua").write_text('--- a\n--- @include "lib/b"\n')
    (tmp_path / "lib" / "b.lua").write_text('--- @include "lib/c"\n')
    (tmp_path / "lib" / "c.lua").write_text('--- @include "lib/b"\n')
    monkeypatch.setattr(lua, "SCRIPT_DIR", tmp_path)
    with pytest.raises(ValueError, match=r"include cycle: a.lua -> lib/b.lua -> lib/c.lua -> lib/b.lua"):
        lua.load("a")


def test_every_line_maps_back_to_its_file_and_line():
    script = lua.SCRIPTS["step"]
    lines = script.source.splitlines()
    for i, (path, number) in enumerate(script.origin, 1):
        assert (lua.SCRIPT_DIR / path).read_text().splitlines()[number - 1] == lines[i - 1]
    at = next(i for i, line in enumerate(lines, 1) if "local function now_ms()" in line)
    assert script.where(at) == f"lib/time.lua:{_line_of('lib/time.lua', 'local function now_ms()')}"


def _line_of(path: str, text: str) -> int:
    return next(i for i, line in enumerate((lua.SCRIPT_DIR / path).read_text().splitlines(), 1) if text in line)


def test_a_runtime_error_in_a_script_names_the_file_and_line(any_redis_url):
    from kvservice.allocator import keys

    r = redis.Redis.from_url(any_redis_url)
    try:
        # An expired lease whose one sequence has a corrupt block table ("zz..." is no hex):
        # reaping it does arithmetic on a reference count that was never loaded, inside
        # lib/refs.lua's decref().
        k = {name: keys.pool_key("p0", name) for name in keys.POOL_KEY_NAMES}
        r.hset(k["meta"], mapping={"epoch": 1, "num_blocks": 4, "block_size": 4})
        r.zadd(k["leases"], {"L1": 0})
        r.zadd(k["lseq"], {"L1:1": 0})
        r.hset(k["seqs"], "1", "L1 3 0 0 " + "ab" * 16 + " 1")
        r.hset(k["tabs"], "1", "zzzzzz")
        script = r.register_script(lua.SCRIPTS["reap"].source)
        with pytest.raises(redis.ResponseError) as info:
            script(keys=keys.pool_keys("p0"), args=[codec.encode({"pool": "p0", "force_lease": "", "max_leases": 1,
                                                                  "max_seqs": 1, "max_blocks": 64, "tombstone_ms": 1})])
        assert "user_script" in str(info.value)
        message = str(_explained("reap", info.value))
        where = f"lib/refs.lua:{_line_of('lib/refs.lua', 'refs[b] = refs[b] - 1')}"
        assert where in message and "user_script" not in message, message
    finally:
        r.close()


def test_error_replies_become_domain_errors_with_their_reason():
    from kvservice import errors

    with pytest.raises(errors.FailedPrecondition) as info:
        codec.decode_reply(codec.encode({"error": "FAILED_PRECONDITION", "message": "lease l has expired",
                                         "reason": "LEASE_EXPIRED"}))
    assert info.value.reason == "LEASE_EXPIRED" and info.value.message == "lease l has expired"
    with pytest.raises(errors.ResourceExhausted) as exhausted:
        codec.decode_reply(codec.encode({"error": "RESOURCE_EXHAUSTED", "message": "m", "needed": 3, "available": 1}))
    assert (exhausted.value.needed, exhausted.value.available, exhausted.value.reason) == (3, 1, "BLOCKS_EXHAUSTED")
    with pytest.raises(codec.ScriptError) as internal:
        codec.decode_reply(codec.encode({"error": "STALE_EPOCH", "message": "m", "epoch": 4}),
                           internal=(codec.STALE_EPOCH,))
    assert internal.value.reply["epoch"] == 4
    assert codec.decode_reply(codec.encode({"epoch": 2, "updates": []})) == {"epoch": 2, "updates": []}

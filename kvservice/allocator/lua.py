"""The Lua scripts: one ``.lua`` file per script in ``scripts/``, helpers in ``scripts/lib/``.

A script pulls in a helper with a line ``--- @include "lib/<name>"``; the loader replaces
the line with the helper's text (itself expanded the same way), each helper once per
script, so a script carries only what it uses. The loader keeps, for every line of the
expanded source, the file and line it came from, so that Redis's error messages
(``user_script:<line>``) can be mapped back to them (``explain``).

Every script file opens with a ``---`` comment block: what it does, each ``KEYS[i]`` and
``ARGV[i]``, and what it returns (the tests check it). Arguments and replies are msgpack
(``kvservice.allocator.codec``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

SCRIPT_DIR = Path(__file__).resolve().parent / "scripts"
INCLUDE = re.compile(r'^--- @include "([A-Za-z0-9_/]+)"\s*$')
_REDIS_LINE = re.compile(r"@?user_script:(\d+)")


@dataclass(frozen=True, slots=True)
class LuaScript:
    """One script, its includes expanded.

    Attributes:
        name: the file's stem (``step`` for ``scripts/step.lua``).
        source: the expanded source that Redis runs.
        origin: for line ``i`` (1-based) of ``source``, ``origin[i - 1]`` is the
            ``(file, line)`` it came from (file relative to ``scripts/``).
    """

    name: str
    source: str
    origin: tuple[tuple[str, int], ...]

    @property
    def header(self) -> str:
        """The script file's opening ``---`` comment block, without the markers."""
        lines = []
        for line in (SCRIPT_DIR / f"{self.name}.lua").read_text().splitlines():
            if not line.startswith("---") or INCLUDE.match(line):
                break
            lines.append(line[3:].strip())
        return "\n".join(lines)

    def where(self, line: int) -> str:
        """``file:line`` of a line of ``source`` (1-based)."""
        if 1 <= line <= len(self.origin):
            path, number = self.origin[line - 1]
            return f"{path}:{number}"
        return f"{self.name}.lua (expanded line {line})"

    def explain(self, message: str) -> str:
        """A Redis error message with each ``user_script:<line>`` replaced by ``file:line``."""
        return _REDIS_LINE.sub(lambda m: self.where(int(m.group(1))), message)


def load(name: str) -> LuaScript:
    """Reads ``scripts/<name>.lua`` and expands its includes.

    Raises:
        FileNotFoundError: no such script or helper.
        ValueError: an include cycle.
    """
    lines: list[str] = []
    origin: list[tuple[str, int]] = []
    _expand(f"{name}.lua", lines, origin, included=set(), stack=[])
    return LuaScript(name, "\n".join(lines) + "\n", tuple(origin))


def _expand(path: str, lines: list[str], origin: list[tuple[str, int]], included: set[str], stack: list[str]) -> None:
    stack.append(path)
    for number, line in enumerate((SCRIPT_DIR / path).read_text().splitlines(), 1):
        m = INCLUDE.match(line)
        if m is None:
            lines.append(line)
            origin.append((path, number))
            continue
        helper = f"{m.group(1)}.lua"
        if helper in stack:
            raise ValueError(f"include cycle: {' -> '.join([*stack, helper])}")
        if helper not in included:
            included.add(helper)
            _expand(helper, lines, origin, included, stack)
    stack.pop()


def names() -> list[str]:
    """Every script (``scripts/*.lua``; helpers in ``lib/`` are not scripts)."""
    return sorted(p.stem for p in SCRIPT_DIR.glob("*.lua"))


#: Every script, loaded once: the registry the store registers with Redis.
SCRIPTS: dict[str, LuaScript] = {name: load(name) for name in names()}

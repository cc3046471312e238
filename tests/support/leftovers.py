"""The suite leaves nothing behind: a session-wide check, hooked in by tests/conftest.py.

At the start it notes the RAM-tier folders in /dev/shm, the short-lived socket folders the
tests make in /tmp, and this process's descendants; at the end a folder that appeared
meanwhile and is still there (and no live daemon holds), or a process the suite started
that is still alive, fails the run and is named. A RAM
tier outlives its daemon on purpose, so only the code that made one removes it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from kvcache.common import lock_is_held
from kvcache.store.ramtier import TIER_PREFIX

SHM = Path("/dev/shm")
# The RAM-tier folders kvcache makes, and the per-run folders the tools make for them.
SHM_PREFIXES = (TIER_PREFIX, "kvcrash-", "kvbench-", "kvbc-")
# Folders the tests make in /tmp for unix sockets (paths must be short): procs.Daemon's
# kvt*, the runtime tests' rtt*, rtc* and rts*, the gateway tests' rtg*.
TMP = Path("/tmp")
TMP_PREFIXES = ("kvt", "rtt", "rtc", "rts", "rtg", "kvredis-")
_BEFORE = pytest.StashKey[tuple[set[str], set[str], set[int]]]()


def shm_folders() -> set[str]:
    return _folders(SHM, SHM_PREFIXES)


def tmp_folders() -> set[str]:
    return _folders(TMP, TMP_PREFIXES)


def _folders(parent: Path, prefixes: tuple[str, ...]) -> set[str]:
    try:
        names = os.listdir(parent)
    except OSError:
        return set()
    return {str(parent / n) for n in names if n.startswith(prefixes)}


def _held(folder: str) -> bool:
    """A live daemon's tier (perhaps another run's, on a shared machine), or a folder
    holding one: not left behind, at least not yet."""
    path = Path(folder)
    if lock_is_held(path):
        return True
    try:
        subs = [p for p in path.iterdir() if p.name.startswith(TIER_PREFIX)]
    except OSError:
        return False
    return any(lock_is_held(p) for p in subs)


def _proc_stat(pid: str) -> tuple[int, str] | None:
    """(parent pid, state) from /proc/PID/stat; None when the process is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
    fields = text[text.rindex(")") + 2:].split()
    return int(fields[1]), fields[0]


def descendants(root: int) -> set[int]:
    """Live (not zombie) descendants of ``root``, read from /proc."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        stat = _proc_stat(name)
        if stat is not None and stat[1] != "Z":
            children.setdefault(stat[0], []).append(int(name))
    found: set[int] = set()
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def command_line(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "?"
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


def record(session: pytest.Session) -> None:
    session.config.stash[_BEFORE] = (shm_folders(), tmp_folders(), descendants(os.getpid()))


def left_behind(session: pytest.Session) -> list[str]:
    """What the run left: one line per folder or process."""
    shm_before, tmp_before, procs_before = session.config.stash[_BEFORE]
    lines = [f"RAM-tier folder left in /dev/shm: {f}"
             for f in sorted(shm_folders() - shm_before) if not _held(f)]
    lines += [f"socket folder left in /tmp: {f}" for f in sorted(tmp_folders() - tmp_before)]
    lines += [f"process still running: pid {pid}: {command_line(pid)}"
              for pid in sorted(descendants(os.getpid()) - procs_before)]
    return lines


def check(session: pytest.Session) -> None:
    """Fail the run (exit status 1) when it left something, saying what."""
    lines = left_behind(session)
    if not lines:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    write = reporter.write_line if reporter is not None else \
        (lambda line: print(line, file=sys.stderr))
    write("")
    write("LEFTOVERS: the test run left these behind (every test removes what it makes):")
    for line in lines:
        write(f"  {line}")
    if session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED

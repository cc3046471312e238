"""Kill a Store in the middle of a removal, at a chosen step, as a crash would (SIGKILL).

A test prepares a data directory in-process, then :func:`kill_during` runs a child process
(``python -m kill_points SPEC``) that opens the store on it, performs one removal (a
delete, a prune, an eviction, a reclaimer's pass, a quarantine, a RAM copy dropped, or the
background check after a crash, kvcache.store.recovery, that removes what a crash left) and
SIGKILLs itself right after the step the spec names. The steps are watched where they happen (the file-system
calls ``os.unlink``, ``os.rename``, ``os.replace`` and ``os.fsync`` of a directory, and
every committed LMDB write transaction), and kill points are named by their effect, not by
their place in the code, so the same kill point exists in any order the store may take:

* ``row_gone``          the index commit after which the watched entry has no row;
* ``ram_flag_cleared``  the index commit after which its row no longer says it is in RAM;
* ``ram_file_gone``     the unlink or rename that took its RAM copy;
* ``before_blob_dir_fsync``  just *before* the fsync of the blob's directory once the
                        blob is gone (the fsync that makes its removal durable);
* ``step:N``            right after the N-th step of any kind (to sweep every step);
* ``never``             no kill: the child reports the steps it took and exits.

Just before dying the child writes what a client could observe at that instant (which
entries have an index row, which rows say "in RAM"), and every file removed from
``blobs/`` whose directory has not been fsynced since: a power cut may bring such a file
back, so each is kept aside as a hard link, and ``power_cut=True`` puts them back (and
empties the RAM tier, as a reboot does) before the test restarts the store. LMDB commits
are durable when they return (``sync=True``), so the index needs no such model.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from harness import payloads
from harness.procs import pythonpath_env

from kvcache import keys
from kvcache.client import Identity
from kvcache.record import Record
from kvcache.store import Store, StoreConfig, ramtier
from kvcache.store.recovery import Recovery
from tests.support.daemon_proc import wait_for

FP = "fp-kill-points"
LAYOUT = {"type_k": "f16"}
IDENT = Identity(FP, LAYOUT, model_name="kill-points.gguf")
NS = IDENT.namespace
BLOCK = 16


def store_config(tmp_path: Path, **overrides: Any) -> StoreConfig:
    """No reclaimer thread unless asked for (its watermarks at 100%): a removal takes the
    same steps every time."""
    settings: dict[str, Any] = {"min_free_bytes": 0, "block_size": BLOCK, "reclaim_low": 1.0,
                                "reclaim_high": 1.0, **overrides}
    return StoreConfig(root=tmp_path / "data", ram_dir=tmp_path / "ram", **settings)


def payload(tokens: list[int], base: int = 0, size: int = 3000) -> bytes:
    return payloads.payload_for(tokens, size, salt=f"/{base}".encode() if base else b"")


def blob_size(tokens: list[int], base: int = 0, size: int = 3000) -> int:
    """The size of the blob :func:`save` writes for these tokens."""
    return len(payloads.blob_bytes(IDENT, tokens, payload(tokens, base, size)))


def save(store: Store, tokens: list[int], *, parent: bytes = b"", base: int = 0,
         size: int = 3000) -> Record:
    """Reserve, write and commit one entry (a piece with ``parent`` and ``base``)."""
    data = payloads.blob_bytes(IDENT, tokens, payload(tokens, base, size), parent=parent,
                               base=base)
    res = store.reserve(NS, keys.tokens_to_bytes(tokens), len(data), "cold", FP,
                        parent=parent, base=base)
    assert res.status == "granted", res
    store.write(res.lease_id, 0, data)
    return store.commit(res.lease_id)


# -- the child: one removal, killed at one step -----------------------------------------------


class _Txn:
    """A write transaction that reports its commit (the end of a ``with`` block)."""

    def __init__(self, txn: Any, on_commit: Callable[[], None]) -> None:
        self._txn = txn
        self._on_commit = on_commit

    def __enter__(self) -> Any:
        return self._txn.__enter__()

    def __exit__(self, *exc: object) -> Any:
        result = self._txn.__exit__(*exc)
        if exc[0] is None:
            self._on_commit()
        return result


class _Env:
    """The index's LMDB environment, its write transactions reporting their commits."""

    def __init__(self, env: Any, on_commit: Callable[[], None]) -> None:
        self._env = env
        self._on_commit = on_commit

    def begin(self, *args: Any, **kwargs: Any) -> Any:
        txn = self._env.begin(*args, **kwargs)
        return _Txn(txn, self._on_commit) if kwargs.get("write") else txn

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)


class Watcher:
    """Counts a removal's steps and kills this process at the one the spec names."""

    def __init__(self, store: Store, spec: dict[str, Any]) -> None:
        self.store = store
        self.kill_at: str = spec["kill_at"]
        self.watched = bytes.fromhex(spec["watch"])
        self.observed = [bytes.fromhex(k) for k in spec["observe"]]
        self.report_path = Path(spec["report"])
        self.limbo = Path(spec["limbo"])
        self.blob_dir = Path(os.path.realpath(store.blob_dir))
        self.steps: list[str] = []
        self.unsynced: dict[str, str] = {}  # original path -> hard link kept aside
        # The real calls, for the watcher's own file work.
        self._os = SimpleNamespace(unlink=os.unlink, rename=os.rename, replace=os.replace,
                                   fsync=os.fsync)

    def arm(self) -> None:
        record = self.store.index.get(self.watched)
        assert record is not None, "the watched entry is not there to remove"
        if self.kill_at in ("ram_flag_cleared", "ram_file_gone"):
            assert record.in_ram and self.store.ram_path(self.watched).exists()
        self.limbo.mkdir(exist_ok=True)
        for name in ("unlink", "rename", "replace"):
            setattr(os, name, self._removal(getattr(self._os, name), name))
        os.fsync = self._fsync(self._os.fsync)
        self.store.index.env = _Env(self.store.index.env, lambda: self._step("index write"))

    def _removal(self, real: Callable[..., None], name: str) -> Callable[..., None]:
        @functools.wraps(real)
        def call(src: Any, *args: Any, **kwargs: Any) -> None:
            path = Path(os.path.realpath(os.fsdecode(src)))
            if path.parent.parent == self.blob_dir and path.is_file():
                # Kept aside until the directory is fsynced: a power cut may undo this.
                aside = self.limbo / str(len(self.steps))
                os.link(path, aside)
                self.unsynced[str(path)] = str(aside)
            real(src, *args, **kwargs)
            self._step(f"{name} {path.name} in {self._where(path.parent)}")
        return call

    def _fsync(self, real: Callable[[int], None]) -> Callable[[int], None]:
        @functools.wraps(real)
        def call(fd: int) -> None:
            if not stat.S_ISDIR(os.fstat(fd).st_mode):
                real(fd)
                return
            synced = os.readlink(f"/proc/self/fd/{fd}")
            blob = Path(os.path.realpath(self.store.blob_path(self.watched)))
            if self.kill_at == "before_blob_dir_fsync" and str(blob.parent) == synced \
                    and not blob.exists():
                self.die()
            real(fd)
            for original in [p for p in self.unsynced if str(Path(p).parent) == synced]:
                self._os.unlink(self.unsynced.pop(original))
            self._step(f"fsync {self._where(Path(synced))}")
        return call

    def _where(self, folder: Path) -> str:
        """A folder's name that is the same in every test's data directory."""
        if folder.parent == self.blob_dir:
            return f"blobs/{folder.name}"
        if folder == Path(os.path.realpath(self.store.ram_dir)):
            return "the RAM tier"
        return folder.name

    def _step(self, what: str) -> None:
        self.steps.append(what)
        if self._reached():
            self.die()

    def die(self) -> None:
        self.write_report(killed=True)
        os.kill(os.getpid(), signal.SIGKILL)

    def _reached(self) -> bool:
        if self.kill_at.startswith("step:"):
            return len(self.steps) == int(self.kill_at[5:])
        if self.kill_at == "row_gone":
            return self.store.index.get(self.watched) is None
        if self.kill_at == "ram_flag_cleared":
            record = self.store.index.get(self.watched)
            return record is None or not record.in_ram
        if self.kill_at == "ram_file_gone":
            return not self.store.ram_path(self.watched).exists()
        return False

    def write_report(self, killed: bool) -> None:
        records = {k: self.store.index.get(k) for k in self.observed}
        self.report_path.write_text(json.dumps({
            "killed": killed,
            "steps": self.steps,
            "rows": {k.hex(): r is not None for k, r in records.items()},
            "in_ram": {k.hex(): r is not None and r.in_ram for k, r in records.items()},
            "unsynced": sorted(self.unsynced.items()),
        }))


def run_operation(store: Store, spec: dict[str, Any]) -> None:
    key = bytes.fromhex(spec["key"])
    op = spec["op"]
    if op == "delete":
        store.delete(key)
    elif op == "prune":
        store.prune(lambda r: r.key == key)
    elif op == "prune_ram":
        store.prune(max_ram_bytes=1)
    elif op == "quarantine":
        assert store.check_entry(key) is not None, "the damaged blob passed its check"
    elif op == "evict":
        save(store, spec["new_tokens"])
    elif op == "reclaim":  # the reclaimer's pass, down to its low watermark
        store.reclaim(force=True)
    elif op == "recover":  # the background check after a crash (held until armed)
        wait_for(lambda: store.recovery().state != "running", "the check after the crash",
                 timeout=60)
        assert store.recovery().state == "done", store.recovery()
    else:
        raise ValueError(f"unknown operation {op!r}")


def hold_recovery(armed: threading.Event) -> None:
    """Make the background check after a crash (kvcache.store.recovery) wait until the
    watcher is armed, so that every one of its steps is watched."""
    real = Recovery._run

    def run_when_armed(self: Recovery) -> None:
        armed.wait()
        real(self)

    Recovery._run = run_when_armed  # type: ignore[method-assign]


def child_main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    config = StoreConfig(root=Path(spec["root"]), ram_dir=Path(spec["ram_dir"]),
                         **spec["settings"])
    armed = threading.Event()
    if spec["op"] == "recover":
        hold_recovery(armed)
    store = Store(config)
    watcher = Watcher(store, spec)
    watcher.arm()
    armed.set()
    run_operation(store, spec)
    watcher.write_report(killed=False)
    store.close()


# -- the test's side --------------------------------------------------------------------------


@dataclass
class Killed:
    """What the child saw: the steps it took, and at the kill what a client could observe."""

    killed: bool
    steps: list[str]
    rows: dict[bytes, bool]
    in_ram: dict[bytes, bool]
    unsynced: list[tuple[str, str]] = field(default_factory=list)

    def gone(self) -> set[bytes]:
        """The entries whose rows were already gone (a lookup or List saw no entry)."""
        return {k for k, there in self.rows.items() if not there}


def kill_during(config: StoreConfig, op: str, key: bytes, *, kill_at: str,
                watch: bytes | None = None, observe: list[bytes] | None = None,
                power_cut: bool = False, new_tokens: list[int] | None = None) -> Killed:
    """Run ``op`` on ``key`` in a child process on ``config``'s data directory (no store
    may have it open) and kill it at ``kill_at`` of entry ``watch`` (default ``key``);
    ``observe``: the entries whose rows are reported (default ``[key]``). With
    ``power_cut``, files removed without a directory fsync since come back and the RAM
    tier is emptied."""
    work = config.root.parent
    spec = {
        "root": str(config.root), "ram_dir": str(config.ram_dir),
        "settings": {"block_size": config.block_size, "min_free_bytes": config.min_free_bytes,
                     "disk_bytes": config.disk_bytes, "ram_bytes": config.ram_bytes,
                     "reclaim_low": config.reclaim_low, "reclaim_high": config.reclaim_high},
        "op": op, "key": key.hex(), "watch": (watch or key).hex(), "kill_at": kill_at,
        "observe": [k.hex() for k in (observe or [key])], "new_tokens": new_tokens or [],
        "report": str(work / "kill-report.json"), "limbo": str(work / "limbo"),
    }
    spec_path = work / "kill-spec.json"
    spec_path.write_text(json.dumps(spec))
    Path(spec["report"]).unlink(missing_ok=True)
    proc = subprocess.run([sys.executable, "-m", "tests.support.kill_points", str(spec_path)],
                          capture_output=True, text=True, timeout=120, env=pythonpath_env())
    expected = 0 if kill_at == "never" else -signal.SIGKILL
    assert proc.returncode == expected, (
        f"the child ended with {proc.returncode}, not {expected} (kill point {kill_at} "
        f"never reached?)\n{proc.stderr[-3000:]}")
    report = json.loads(Path(spec["report"]).read_text())
    killed = Killed(report["killed"], report["steps"],
                    {bytes.fromhex(k): v for k, v in report["rows"].items()},
                    {bytes.fromhex(k): v for k, v in report["in_ram"].items()},
                    [tuple(p) for p in report["unsynced"]])
    if power_cut:
        cut_power(config, killed)
    shutil.rmtree(spec["limbo"], ignore_errors=True)
    return killed


def cut_power(config: StoreConfig, killed: Killed) -> None:
    """What a power cut at the kill may leave: each file removed from ``blobs/`` since its
    directory's last fsync back in place, and an empty RAM tier (a memory file system)."""
    for original, aside in killed.unsynced:
        if not os.path.exists(original):
            os.rename(aside, original)
    shutil.rmtree(ramtier.tier_dir(config.root, config.ram_dir), ignore_errors=True)


if __name__ == "__main__":
    child_main(sys.argv[1])

"""A removal that a client could have seen stays done after a crash at any instant.

Each test prepares a data directory, kills a store process in the middle of one removal
(a delete, a prune, an eviction, a reclaimer's pass, a quarantine, a RAM copy dropped; see
tests/support/kill_points.py for how a kill point is named and reached), with or without a
power cut on top, restarts the store and checks what it finds:

* an entry whose index row was already gone at the kill (a lookup or List would have
  missed it, its removal may have been answered) is still gone: no row, no blob file, no
  RAM copy. A crash never brings a deleted entry back;
* a RAM copy whose row no longer said "in RAM" is not back in RAM;
* every entry that is there is whole (its bytes are the ones saved), every piece has its
  parent, and index and files agree (each row has its blob of its size, each blob and RAM
  copy its row);
* the entries the removal did not target are untouched, and a removed entry's tokens can
  be saved again (nothing left behind blocks or swallows a new save of the same key).

Real store code in a real child process killed with SIGKILL, real LMDB, real files.
"""

from __future__ import annotations

import random
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
from harness import payloads

from kvcache import blob as blobfmt
from kvcache import keys
from kvcache.errors import StoreError
from kvcache.index import Index
from kvcache.record import Record
from kvcache.store import Store, StoreConfig
from tests.support.kill_points import (
    BLOCK,
    IDENT,
    NS,
    Killed,
    blob_size,
    kill_during,
    payload,
    save,
    store_config,
)
from tests.support.stores import recovered


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 50_000) for _ in range(n)]


TARGET = tokens(1, 40)  # the entry a removal takes (and the pieces built on it)
BYSTANDER = tokens(2, 30)  # one it does not


@dataclass
class Prepared:
    """The entries a test made: the removal's target, what is built on it, a bystander."""

    config: StoreConfig
    target: Record
    pieces: list[Record] = field(default_factory=list)
    bystander: Record | None = None
    # key -> (tokens, base): what each entry's bytes must be
    saved: dict[bytes, tuple[list[int], int]] = field(default_factory=dict)

    @property
    def removed(self) -> list[bytes]:
        """The entries the removal takes: the target and everything built on it."""
        return [self.target.key, *(p.key for p in self.pieces)]


def prepare(tmp_path: Path, *, ram: bool, pieces: int = 0, **settings: int) -> Prepared:
    """A target entry (with ``pieces`` pieces built on it, each on the one before), then
    a bystander; with ``ram``, every one of them also has its RAM copy."""
    config = store_config(tmp_path, ram_bytes=(1 << 30) if ram else 0, **settings)
    store = Store(config)
    try:
        base_tokens = TARGET
        target = save(store, base_tokens)
        prepared = Prepared(config, target, saved={target.key: (base_tokens, 0)})
        parent, parent_tokens = target, base_tokens
        for i in range(pieces):
            piece_tokens = parent_tokens + tokens(10 + i, 20)
            piece = save(store, piece_tokens, parent=parent.key, base=len(parent_tokens))
            prepared.pieces.append(piece)
            prepared.saved[piece.key] = (piece_tokens, len(parent_tokens))
            parent, parent_tokens = piece, piece_tokens
        bystander_tokens = BYSTANDER
        prepared.bystander = save(store, bystander_tokens)
        prepared.saved[prepared.bystander.key] = (bystander_tokens, 0)
        store._ram_worker.submit(lambda: None).result(timeout=30)  # copies made
        in_ram = [r.in_ram for r in store.index.records()]
        assert in_ram == [ram] * len(in_ram), "RAM copies are not as the test needs them"
    finally:
        store.close()
    return prepared


def read_all(store: Store, key: bytes) -> bytes:
    _pin, chunks = store.iter_read(key)
    return b"".join(bytes(c) for c in chunks)


def assert_index_and_files_agree(store: Store) -> dict[bytes, Record]:
    """Every row has its blob of its size, and its RAM copy when it says so; every blob
    and RAM copy has its row; no temp file; no piece without its parent."""
    rows = {r.key: r for r in store.index.records()}
    blobs = {bytes.fromhex(p.stem): p.stat().st_size for p in store.blob_dir.glob("*/*.kvc")}
    copies = {bytes.fromhex(p.stem): p.stat().st_size for p in store.ram_dir.glob("*.kvc")}
    assert blobs == {k: r.size for k, r in rows.items()}, "index rows and blob files differ"
    assert copies == {k: r.size for k, r in rows.items() if r.in_ram}, \
        "index RAM flags and RAM copies differ"
    assert not list(store.root.rglob("*.part")) and not list(store.ram_dir.glob("*.part"))
    orphans = [r.key.hex() for r in rows.values() if r.parent and r.parent not in rows]
    assert orphans == [], f"pieces listed without their parent: {orphans}"
    return rows


def check_after_restart(prepared: Prepared, killed: Killed, *, whole: bool = True) -> None:
    """Restart the store on the killed one's directory and check what the module
    docstring promises. ``whole=False``: the target's blob was damaged on purpose (a
    quarantine), so if it is still there its bytes are not compared."""
    store = Store(prepared.config)
    try:
        recovered(store)  # after a kill the check runs in the background
        rows = assert_index_and_files_agree(store)
        back = sorted(k.hex() for k in killed.gone() if k in rows)
        assert back == [], f"removed (their rows gone at the kill), back after restart: {back}"
        for key in killed.gone():
            assert not store.blob_path(key).exists() and not store.ram_path(key).exists()
        for key, was_in_ram in killed.in_ram.items():
            if killed.rows[key] and not was_in_ram and key in rows:
                assert not rows[key].in_ram, "a dropped RAM copy is back in RAM"
        assert prepared.bystander is not None and prepared.bystander.key in rows, \
            "an entry the removal did not target is gone"
        for key in rows:
            if key == prepared.target.key and not whole:
                continue
            entry_tokens, base = prepared.saved[key]
            blob = blobfmt.decode_blob(read_all(store, key))
            assert list(blob.meta.tokens) == entry_tokens
            assert bytes(blob.payload) == payload(entry_tokens, base), \
                f"entry {key.hex()} holds other bytes than were saved"
        if prepared.target.key not in rows:  # its key is free for a new save
            target_tokens, _ = prepared.saved[prepared.target.key]
            again = save(store, target_tokens)
            assert again.key == prepared.target.key
            assert bytes(blobfmt.decode_blob(read_all(store, again.key)).payload) == \
                payload(target_tokens)
        store._ram_worker.submit(lambda: None).result(timeout=30)  # copies the reads made
        assert_index_and_files_agree(store)
    finally:
        store.close()


def damage_target(prepared: Prepared) -> None:
    """Flip a payload byte of the target's blob (its size and header stay as they were),
    so that a check of it quarantines it."""
    path = prepared.config.root / "blobs" / prepared.target.key.hex()[:2] / \
        f"{prepared.target.key.hex()}.kvc"
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))


# The removals, each as one operation on a prepared directory.
REMOVALS = {
    "delete with its RAM copy": dict(op="delete", ram=True),
    "delete, no RAM copy": dict(op="delete", ram=False),
    "delete of an entry with two pieces built on it": dict(op="delete", ram=True, pieces=2),
    "prune": dict(op="prune", ram=True),
    "eviction": dict(op="evict", ram=False),
    # The reclaimer takes the target's pieces, then the target (the least recently used),
    # removing their files with the store lock let go.
    "reclaimer's pass": dict(op="reclaim", ram=True, pieces=2),
    "quarantine with its RAM copy": dict(op="quarantine", ram=True),
}


def kill_removal(tmp_path: Path, removal: str, kill_at: str, *, power_cut: bool = False
                 ) -> tuple[Prepared, Killed]:
    spec = REMOVALS[removal]
    settings: dict[str, int] = {}
    new_tokens = None
    if spec["op"] == "evict":
        # Room for the target and the bystander, not for a third entry: saving one evicts
        # the least recently used, the target.
        new_tokens = tokens(3, 35)
        settings["disk_bytes"] = sum(blob_size(t) for t in (TARGET, BYSTANDER, new_tokens)) - 1
    prepared = prepare(tmp_path, ram=bool(spec["ram"]), pieces=int(spec.get("pieces", 0)),
                       **settings)
    if spec["op"] == "quarantine":
        damage_target(prepared)
    config = prepared.config
    if spec["op"] == "reclaim":
        # The child's budget: the bystander alone is at the low watermark, so everything
        # older goes. (No thread: the pass runs when the child asks for it.)
        config = replace(config, disk_bytes=2 * blob_size(BYSTANDER), reclaim_low=0.5)
    killed = kill_during(config, str(spec["op"]), prepared.target.key,
                         kill_at=kill_at, observe=prepared.removed, power_cut=power_cut,
                         new_tokens=new_tokens)
    return prepared, killed


# -- one test per window ----------------------------------------------------------------------


@pytest.mark.parametrize("removal", [r for r in REMOVALS if not r.startswith("quarantine")])
def test_a_removal_killed_right_after_its_index_commit_stays_done(
        tmp_path: Path, removal: str) -> None:
    """Killed as soon as the index no longer lists the entry: a lookup or List already
    missed it (the delete may have been answered), so it must stay gone, also when its
    files were still there (the blob would be re-indexed from its header at start-up)."""
    prepared, killed = kill_removal(tmp_path, removal, "row_gone")
    assert prepared.target.key in killed.gone()
    check_after_restart(prepared, killed)


@pytest.mark.parametrize("removal", ["delete with its RAM copy",
                                     "delete of an entry with two pieces built on it"])
def test_a_delete_killed_between_its_ram_copy_and_its_blob_stays_done(
        tmp_path: Path, removal: str) -> None:
    """Killed right after the RAM copy went, the blob file perhaps still there."""
    prepared, killed = kill_removal(tmp_path, removal, "ram_file_gone")
    check_after_restart(prepared, killed)


@pytest.mark.parametrize("removal", list(REMOVALS))
def test_a_removal_killed_before_its_directory_fsync_stays_done_after_a_power_cut(
        tmp_path: Path, removal: str) -> None:
    """Killed with the blob unlinked (or moved to quarantine) but its directory not yet
    fsynced, then a power cut: the file may come back. An entry whose row was gone by
    then must not come back with it."""
    prepared, killed = kill_removal(tmp_path, removal, "before_blob_dir_fsync",
                                    power_cut=True)
    check_after_restart(prepared, killed, whole=not removal.startswith("quarantine"))


def test_a_quarantine_killed_right_after_its_index_commit_stays_done_after_a_power_cut(
        tmp_path: Path) -> None:
    """A quarantine moves the bad blob aside: killed once the index no longer lists it,
    then a power cut, the move may be undone; the damaged entry must not be listed (and
    served) again."""
    prepared, killed = kill_removal(tmp_path, "quarantine with its RAM copy", "row_gone",
                                    power_cut=True)
    check_after_restart(prepared, killed, whole=False)


def test_a_ram_copy_dropped_by_a_prune_stays_dropped_after_a_kill(tmp_path: Path) -> None:
    """``prune --max-ram-bytes`` answered that the copies went: killed as soon as the index
    says the target is no longer in RAM, its copy on the memory file system (which
    outlives the daemon) must not be taken for a copy again at start-up."""
    prepared = prepare(tmp_path, ram=True)
    killed = kill_during(prepared.config, "prune_ram", prepared.target.key,
                         kill_at="ram_flag_cleared")
    assert killed.rows[prepared.target.key] and not killed.in_ram[prepared.target.key]
    check_after_restart(prepared, killed)


# -- every step ---------------------------------------------------------------------------------


@pytest.mark.parametrize("power_cut", [False, True], ids=["kill", "power cut"])
@pytest.mark.parametrize("removal", ["delete of an entry with two pieces built on it",
                                     "reclaimer's pass"])
def test_a_removal_with_pieces_and_ram_copies_killed_at_every_step_is_never_undone(
        tmp_path: Path, power_cut: bool, removal: str) -> None:
    """Whatever order the store takes its steps in: a kill (and a power cut) right after
    each index write, unlink, rename and directory fsync of the delete of an entry with
    two pieces built on it, all with RAM copies, and of the reclaimer's pass that takes
    them (its files removed with the store lock let go)."""
    clean = tmp_path / "clean"
    prepared, done = kill_removal(clean, removal, "never")
    assert not done.killed and set(done.gone()) == set(prepared.removed)
    check_after_restart(prepared, done)
    for step in range(1, len(done.steps) + 1):
        prepared, killed = kill_removal(tmp_path / f"step{step}", removal, f"step:{step}",
                                        power_cut=power_cut)
        assert killed.steps == done.steps[:step], "the delete took other steps this time"
        check_after_restart(prepared, killed)
        shutil.rmtree(tmp_path / f"step{step}")


def crashed(tmp_path: Path) -> tuple[Prepared, bytes]:
    """A data directory as a kill leaves it (no clean-shutdown record) in the middle of the
    delete of an entry with two pieces built on it, all with RAM copies (the entry's blob
    gone, the rows there), with a publish cut short (a blob without its row: its key is
    returned) and the bystander's RAM copy lost."""
    prepared = prepare(tmp_path, ram=True, pieces=2)
    assert prepared.bystander is not None
    orphan_tokens = tokens(4, 30)
    store = Store(prepared.config)
    try:
        target_blob = store.blob_path(prepared.target.key)
        lost_copy = store.ram_path(prepared.bystander.key)
        orphan = keys.entry_key(NS, orphan_tokens, BLOCK).key
        orphan_blob = store.blob_path(orphan)
    finally:
        store.close()
    index = Index(prepared.config.root / "index")
    index.mark_open()  # a killed daemon writes no clean-shutdown record
    index.close()
    target_blob.unlink()
    lost_copy.unlink()
    orphan_blob.parent.mkdir(exist_ok=True)
    orphan_blob.write_bytes(payloads.blob_bytes(IDENT, orphan_tokens, payload(orphan_tokens)))
    prepared.saved[orphan] = (orphan_tokens, 0)
    return prepared, orphan


@pytest.mark.parametrize("power_cut", [False, True], ids=["kill", "power cut"])
def test_the_check_after_a_crash_killed_at_every_step_undoes_nothing(
        tmp_path: Path, power_cut: bool) -> None:
    """The background check after a crash (kvcache.store.recovery) removes the rows whose
    blob is gone with what is built on them, indexes a blob without its row and clears a
    lost RAM copy's flag: killed (and with a power cut) right after each of its steps, the
    next start-up's check finishes the job, and nothing it removed comes back."""
    prepared, orphan = crashed(tmp_path / "clean")
    done = kill_during(prepared.config, "recover", prepared.target.key, kill_at="never",
                       observe=prepared.removed)
    assert not done.killed and set(done.gone()) == set(prepared.removed)
    check_after_restart(prepared, done)
    store = Store(prepared.config)
    try:
        rows = {r.key: r for r in store.index.records()}
        assert orphan in rows, "the blob without its row was not indexed"
    finally:
        store.close()
    for step in range(1, len(done.steps) + 1):
        prepared, orphan = crashed(tmp_path / f"step{step}")
        killed = kill_during(prepared.config, "recover", prepared.target.key,
                             kill_at=f"step:{step}", observe=prepared.removed,
                             power_cut=power_cut)
        assert killed.steps == done.steps[:step], "the check took other steps this time"
        check_after_restart(prepared, killed)
        shutil.rmtree(tmp_path / f"step{step}")


def test_a_deleted_entry_stays_gone_when_the_index_is_rebuilt(tmp_path: Path) -> None:
    """A lost index is rebuilt from the blob files alone: a delete that was answered left
    no file to rebuild it from."""
    prepared = prepare(tmp_path, ram=True, pieces=1)
    store = Store(prepared.config)
    try:
        assert [r.key for r in store.delete(prepared.target.key)] == prepared.removed
    finally:
        store.close()
    shutil.rmtree(prepared.config.root / "index")
    killed = Killed(True, [], {k: False for k in prepared.removed},
                    {k: False for k in prepared.removed})
    check_after_restart(prepared, killed)


def test_a_blob_that_cannot_be_removed_stops_the_removal_and_breaks_no_chain(
        tmp_path: Path) -> None:
    """The unlink of a piece's blob fails (here: a directory stands where the file was):
    the delete fails with a clear error, the piece built on it is gone (its file went
    first), the piece and its parent stay published, and a later delete finishes."""
    prepared = prepare(tmp_path, ram=False, pieces=2)
    target, middle, leaf = prepared.removed
    assert prepared.bystander is not None
    store = Store(prepared.config)
    try:
        blob = store.blob_path(middle)
        kept = blob.read_bytes()
        blob.unlink()
        (blob / "in the way").mkdir(parents=True)
        with pytest.raises(StoreError, match=f"could not remove the blob of entry {middle.hex()}"):
            store.delete(target)
        rows = {r.key for r in store.index.records()}
        assert leaf not in rows and not store.blob_path(leaf).exists()
        assert {target, middle} <= rows
        assert store.stats()["counters"]["dependents_removed"] == 1
        shutil.rmtree(blob)
        blob.write_bytes(kept)
        assert [r.key for r in store.delete(target)] == [target, middle]
        assert_index_and_files_agree(store)
        assert store.stats()["disk_used"] == prepared.bystander.size
    finally:
        store.close()

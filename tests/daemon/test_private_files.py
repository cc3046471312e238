"""Everything kvcache writes is its owner's alone, whatever the umask, and a RAM tier's
name taken by someone else in a shared ``--ram-dir`` neither stops the daemon nor is
touched by it.

Against real daemon processes: one started under umask 000 (what the daemon writes in
its data directory and its RAM tier, and the folders it makes on the way to them), and
one whose tier name another user (or a loose mode, or a symlink) took first.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from harness.payloads import payload_for

from kvcache.store.ramtier import RAM_MARKER, tier_name
from tests.support.daemon_proc import DaemonProcess, wait_for
from tests.support.entries import IDENT, toks

OTHER_UID = 4242  # a user that is not this one (the tests run as root and may chown)


@pytest.fixture
def daemons(tmp_path: Path) -> Iterator[Callable[..., DaemonProcess]]:
    made: list[DaemonProcess] = []

    def make(data_dir: Path, ram_parent: Path) -> DaemonProcess:
        d = DaemonProcess(data_dir, ram_parent=ram_parent,
                          log_path=tmp_path / f"daemon-{len(made)}.log")
        made.append(d)
        return d

    yield make
    for d in made:
        d.close()


def save_in_ram(d: DaemonProcess, seed: int) -> bytes:
    tokens = toks(seed, 40)
    with d.client() as c:
        key = c.save(IDENT, tokens, payload_for(tokens, 50_000), "cold").key
        wait_for(lambda: key in {e.key for e in c.list_entries(tier="ram")},
                 "the entry placed in the RAM tier")
    return key


def modes_under(root: Path) -> dict[str, str]:
    """Each path under ``root`` (itself included) with its kind and mode, as ``d 0700``."""
    found = {}
    for path in [root, *sorted(root.rglob("*"))]:
        st = path.lstat()
        kind = "d" if stat.S_ISDIR(st.st_mode) else "f" if stat.S_ISREG(st.st_mode) else "?"
        found[str(path.relative_to(root.parent))] = f"{kind} {stat.S_IMODE(st.st_mode):04o}"
    return found


def test_everything_written_is_owner_only_under_umask_000(
        tmp_path: Path, daemons: Callable[..., DaemonProcess]) -> None:
    """Data directory, index, blobs, lock, markers, RAM copies, and the missing folders on
    the way to the data directory and the RAM tier: 0700 folders, 0600 files (RAM copies
    were 0666 and daemon.lock 0666 under umask 000)."""
    made_here = tmp_path / "new"
    d = daemons(made_here / "deep" / "data", made_here / "shm" / "ram")
    old = os.umask(0)
    try:
        d.start()
    finally:
        os.umask(old)
    key = save_in_ram(d, 71)
    assert (d.ram_dir / f"{key.hex()}.kvc").is_file()
    assert (d.data_dir / "daemon.lock").is_file()
    d.stop()
    found = modes_under(made_here)
    assert len([m for m in found.values() if m.startswith("f")]) >= 6, found
    loose = {path: mode for path, mode in found.items()
             if mode not in ("d 0700", "f 0600")}
    assert loose == {}


def test_an_earlier_versions_loose_lock_file_is_made_owner_only(
        tmp_path: Path, daemons: Callable[..., DaemonProcess]) -> None:
    d = daemons(tmp_path / "data", tmp_path / "ram").start()
    d.stop()
    lock = d.data_dir / "daemon.lock"
    lock.chmod(0o666)
    d.start()
    assert stat.S_IMODE(lock.stat().st_mode) == 0o600


def squat(tier: Path, how: str) -> None:
    """Take the tier's name first, as another user (or a careless one) could."""
    if how == "symlink":
        elsewhere = tier.parent / "elsewhere"
        elsewhere.mkdir(mode=0o700)
        tier.symlink_to(elsewhere)
        return
    tier.mkdir(mode=0o700)
    (tier / "theirs.txt").write_text("not kvcache's")
    if how == "other_user":
        os.chown(tier, OTHER_UID, OTHER_UID)
        os.chown(tier / "theirs.txt", OTHER_UID, OTHER_UID)
    else:  # our own folder, but others may enter it
        tier.chmod(0o755)


def state_of(path: Path) -> list[tuple[str, int, int, int, bytes | None]]:
    """Every path under ``path`` (not following a symlink) with owner, mode and bytes."""
    out = []
    for p in [path, *(sorted(path.rglob("*")) if not path.is_symlink() else [])]:
        st = p.lstat()
        data = p.read_bytes() if stat.S_ISREG(st.st_mode) else None
        out.append((str(p), st.st_uid, st.st_mode, st.st_nlink, data))
    return out


@pytest.mark.parametrize("how", ["other_user", "loose_mode", "symlink"])
def test_a_squatted_tier_name_is_left_alone_and_another_is_used(
        tmp_path: Path, daemons: Callable[..., DaemonProcess], how: str) -> None:
    """A folder of the tier's name in a shared --ram-dir used to stop the daemon from
    starting ("is not a private folder of this user"). It is left exactly as it was, the
    daemon says so, takes a name nobody could guess, and finds that tier again (warm)
    after a restart."""
    parent = tmp_path / "shm"
    parent.mkdir()
    parent.chmod(0o1777)  # as /dev/shm
    data = tmp_path / "data"
    squatted = parent / tier_name(data)
    squat(squatted, how)
    before = state_of(squatted)
    d = daemons(data, parent).start()
    key = save_in_ram(d, 72 + len(how))
    with d.client() as c:
        ram = next(t for t in c.stats().tiers if t.directory != str(d.data_dir))
    tier = Path(ram.directory)
    assert tier != squatted and tier.parent == parent
    assert tier.name.startswith(squatted.name + "-") and len(tier.name) == len(squatted.name) + 17
    assert stat.S_IMODE(tier.stat().st_mode) == 0o700 and (tier / RAM_MARKER).is_file()
    assert f"{squatted} is not this daemon's RAM tier" in d.log() and "left alone" in d.log()
    d.stop()
    d.start()
    with d.client() as c:
        assert c.load(key).tier == "ram", "the renamed tier was found again, warm"
        again = next(t for t in c.stats().tiers if t.directory != str(d.data_dir))
    assert again.directory == str(tier)
    d.stop()
    assert state_of(squatted) == before
    assert sorted(p.name for p in parent.iterdir()) == sorted(
        {squatted.name, tier.name} | ({"elsewhere"} if how == "symlink" else set()))

"""The RAM tier's folder: where it is, how a daemon claims it, and how orphans are found.

The tier always lives in a subfolder of its own, ``PARENT/kvcache-<uid>-<tag>`` (the tag
is derived from the data directory's resolved path), which kvcache creates and marks with
``.kvcache-ram`` naming its data directory. A running daemon holds an exclusive flock on
the folder, so a tier is known to be in use without asking any process. A tier outlives
its daemon on purpose (a restart finds its copies warm); one whose data directory is gone
is an orphan, which ``kvcache ram-tiers --remove TIER`` or ``--remove-orphans`` removes. A
folder of the same name whose marker kvcache did not write (another program's, or none)
is never removed.

The folder's name is known to everyone who can list ``PARENT``, and ``PARENT`` may be
shared (``/dev/shm`` is): another user can make a folder of that name first. Such a
folder is left alone (logged) and the tier takes a name of its own beside it,
``kvcache-<uid>-<tag>-<random>``, which nobody can guess beforehand; later starts find it
again by its marker (tests/daemon/test_ownership.py::
test_a_squatted_tier_name_is_left_alone_and_another_is_used).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import secrets
import stat
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from .. import keys
from ..common import lock_is_held, make_private_dirs
from .ownership import NotOwned, is_own_file_name, read_marker, write_marker

log = logging.getLogger("kvcache")

RAM_MARKER = ".kvcache-ram"
# What kvcache's RAM markers say (always have): a marker saying anything else, even a
# well-formed one, is not kvcache's.
RAM_MARKER_WHAT = "kvcache RAM tier: copies of hot cache entries"
TIER_PREFIX = "kvcache-"
SHM = Path("/dev/shm")


def tier_name(data_dir: Path) -> str:
    return f"{TIER_PREFIX}{os.getuid()}-{keys.tenant_id(str(data_dir.resolve()))[:12]}"


def tier_dir(data_dir: Path, parent: Path | None = None) -> Path:
    """The RAM tier folder of ``data_dir`` under ``parent`` (``--ram-dir``). By default
    under /dev/shm; on a machine without it, ``ram`` in the data directory (a folder of
    kvcache's own already, so it needs no subfolder)."""
    if parent is None:
        if not SHM.is_dir():
            return data_dir / "ram"
        parent = SHM
    return parent / tier_name(data_dir)


def _not_private(path: Path) -> str | None:
    """Why ``path`` is not a private folder of this user (None: it is). Reads its inode
    only, never its contents."""
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a folder"
    if st.st_uid != os.getuid():
        return f"it belongs to uid {st.st_uid}"
    if st.st_mode & 0o077:
        return f"its mode is {stat.S_IMODE(st.st_mode):04o}, not 0700"
    return None


def claim_tier(data_dir: Path, parent: Path | None = None) -> tuple[Path, int]:
    """Find or make the RAM tier of ``data_dir`` under ``parent`` (``--ram-dir``) and lock
    it; returns the folder and its open descriptor, which holds the lock until closed.

    The tier is ``tier_dir``'s folder when it is a private folder of this user (or does
    not exist yet and no tier of another name was made before). A folder of that name
    that is not (another user's, a loose mode, not a folder) is left untouched: the tier
    of another name made beside it before is used, or a new one. Refuses a folder that
    is another data directory's tier or is in use."""
    tier = tier_dir(data_dir, parent)
    if tier.parent == data_dir:  # no memory file system: a folder of the data directory's
        return tier, _lock_tier(tier, data_dir)
    make_private_dirs(tier.parent)
    found, squatted = _find_tier(tier, data_dir)
    if squatted is not None:
        log.warning("%s is not this daemon's RAM tier (%s): left alone; the tier is %s",
                    tier, squatted, found or "a folder of another name beside it")
    if found is not None:
        return found, _lock_tier(found, data_dir)
    if squatted is None:  # free: the usual name
        with contextlib.suppress(FileExistsError):  # made meanwhile: checked when locked
            tier.mkdir(mode=0o700)
        return tier, _lock_tier(tier, data_dir)
    while True:
        other = tier.with_name(f"{tier.name}-{secrets.token_hex(8)}")
        try:
            other.mkdir(mode=0o700)
        except FileExistsError:
            continue
        return other, _lock_tier(other, data_dir)


def tier_in_use(data_dir: Path, parent: Path | None = None) -> Path:
    """The folder :func:`claim_tier` finds (or would make under the usual name) for
    ``data_dir``; changes nothing."""
    tier = tier_dir(data_dir, parent)
    if tier.parent == data_dir or not tier.parent.is_dir():
        return tier
    return _find_tier(tier, data_dir)[0] or tier


def _find_tier(tier: Path, data_dir: Path) -> tuple[Path | None, str | None]:
    """``(the existing tier of data_dir, why tier's name is taken)``: ``tier`` itself when
    it is a private folder of this user, else one made beside it under another name (or
    None); the reason is None when the name is ours or free."""
    if not tier.exists() and not tier.is_symlink():
        return _renamed_tier(tier, data_dir), None
    why = _not_private(tier)
    if why is None:
        return tier, None
    return _renamed_tier(tier, data_dir), why


def _renamed_tier(tier: Path, data_dir: Path) -> Path | None:
    """A tier of ``data_dir`` made beside ``tier`` under another name (``<name>-<hex>``)
    because ``tier``'s name was taken: a private folder of this user whose marker names
    ``data_dir``. Folders of other users are not looked into."""
    owner = str(data_dir.resolve())
    pattern = re.compile(re.escape(tier.name) + r"-[0-9a-f]{16}")
    with os.scandir(tier.parent) as entries:
        names = sorted(e.name for e in entries if pattern.fullmatch(e.name))
    for name in names:
        path = tier.parent / name
        with contextlib.suppress(OSError):
            if _not_private(path) is None:
                fields = kvcache_marker(path)
                if fields is not None and fields.get("data_dir") == owner:
                    return path
    return None


def _lock_tier(tier: Path, data_dir: Path) -> int:
    """Lock ``tier`` for ``data_dir``, marking it when new; its open descriptor."""
    owner = str(data_dir.resolve())
    if not tier.exists() and not tier.is_symlink():
        make_private_dirs(tier)
    why = _not_private(tier)
    if why is not None:
        raise NotOwned(f"{tier} is not a private folder of this user ({why}): remove it or "
                       "choose another --ram-dir")
    fd = os.open(tier, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise NotOwned(f"{tier} is in use by another kvcache daemon") from None
        fields = read_marker(tier / RAM_MARKER)
        if fields is not None and fields.get("data_dir") != owner:
            raise NotOwned(f"{tier} is the RAM tier of {fields.get('data_dir')}, not of "
                           f"{owner}: choose another --ram-dir")
        if fields is None:  # new, or made by a version that wrote no marker (same name)
            write_marker(tier / RAM_MARKER, {"what": RAM_MARKER_WHAT, "data_dir": owner})
    except BaseException:
        os.close(fd)
        raise
    return fd


def kvcache_marker(tier: Path) -> dict[str, object] | None:
    """The tier's marker fields if kvcache wrote the marker (it says so), else None."""
    fields = read_marker(tier / RAM_MARKER)
    return fields if fields is not None and fields.get("what") == RAM_MARKER_WHAT else None


def own_files(tier: Path) -> Iterator[Path]:
    """The files in ``tier`` kvcache made: blob copies and cut-short copies."""
    with os.scandir(tier) as entries:
        for entry in entries:
            if is_own_file_name(entry.name) and entry.is_file(follow_symlinks=False):
                yield Path(entry.path)


# ------------------------------------------------------------------------- finding tiers


@dataclass(frozen=True)
class TierInfo:
    path: str
    data_dir: str  # "" when unmarked
    bytes: int
    data_dir_exists: bool
    in_use: bool
    state: str  # in_use | idle (its data directory exists) | orphan | unmarked (no marker
    #             that says kvcache made it)
    foreign_names: int  # entries kvcache did not make (it never removes those)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def describe_tier(tier: Path) -> TierInfo:
    fields = kvcache_marker(tier)
    data_dir = str(fields.get("data_dir", "")) if fields else ""
    size = foreign = 0
    with os.scandir(tier) as entries:
        for entry in entries:
            if entry.name == RAM_MARKER:
                continue
            if not (is_own_file_name(entry.name) and entry.is_file(follow_symlinks=False)):
                foreign += 1
                continue
            with contextlib.suppress(OSError):
                size += entry.stat(follow_symlinks=False).st_size
    exists = bool(data_dir) and Path(data_dir).is_dir()
    in_use = lock_is_held(tier) or \
        (exists and lock_is_held(Path(data_dir) / "daemon.lock"))
    state = ("unmarked" if not fields else "in_use" if in_use
             else "idle" if exists else "orphan")
    return TierInfo(str(tier), data_dir, size, exists, in_use, state, foreign)


def find_tiers(parents: Iterable[Path]) -> list[TierInfo]:
    """The folders named like a RAM tier of this user in each parent."""
    prefix = f"{TIER_PREFIX}{os.getuid()}-"
    found = []
    for parent in parents:
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            for entry in sorted(os.scandir(parent), key=lambda e: e.name):
                if entry.name.startswith(prefix) and entry.is_dir(follow_symlinks=False):
                    with contextlib.suppress(OSError):  # removed meanwhile
                        found.append(describe_tier(Path(entry.path)))
    return found


def remove_orphan(tier: Path) -> str | None:
    """Remove an orphan tier: our files, the marker, then the folder. Returns why it was
    kept, or None once removed. The tier's lock is taken first, so a daemon starting on
    it meanwhile is not robbed (it fails to lock, or we do and keep the folder)."""
    marker = tier / RAM_MARKER
    fields = kvcache_marker(tier)
    if fields is None:
        return "it has no marker saying kvcache made it"
    data_dir = str(fields.get("data_dir", ""))
    if not data_dir:
        return "its marker names no data directory"
    if Path(data_dir).exists():
        return f"its data directory {data_dir} exists"
    try:
        fd = os.open(tier, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        return f"cannot open it: {exc.strerror}"
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return "a kvcache daemon is using it"
        foreign = [p for p in os.listdir(tier)
                   if p != RAM_MARKER and not is_own_file_name(p)]
        if foreign:
            return f"it holds {len(foreign)} entries kvcache did not make"
        for path in own_files(tier):
            path.unlink(missing_ok=True)
        marker.unlink()
        tier.rmdir()  # while locked: a daemon claiming it meanwhile fails, not we
    except OSError as exc:
        return f"cannot remove it: {exc.strerror}"
    finally:
        os.close(fd)
    return None

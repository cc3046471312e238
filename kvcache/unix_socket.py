"""A server's unix socket that takes no path it does not own and removes only its own.

Used by the cache daemon and the model runtime alike. A path holding anything but a
socket, or a socket something listens on, is refused; only a stale socket (nobody
accepts on it) is replaced. gRPC removes the path it bound when it shuts down, whatever
is there by then, so the socket is bound under a temporary name only this process uses
and then linked to its path: the link fails rather than replace a socket another process
put there meanwhile, and at shutdown the path is removed only while it is still the
socket made here. The socket (mode 0600) lives in a folder only its owner can enter: one
made for it is made 0700, and one that others can enter is refused, never changed
(tests/daemon/test_ownership.py holds these rules).
"""

from __future__ import annotations

import itertools
import os
import socket
import stat
from pathlib import Path

import grpc

from .common import make_private_dirs
from .config import MAX_SOCKET_PATH

_bind_serial = itertools.count()


def file_id(path: Path) -> tuple[int, int] | None:
    """(device, inode) of ``path`` itself, or None when there is nothing there."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def claim_socket_path(path: Path, remove_stale: bool = True) -> None:
    """Make ``path`` free for our socket. Only a stale socket (nobody accepts on it) is
    removed; a file of another kind, or a socket something listens on, is refused. With
    ``remove_stale`` False it only checks, changing nothing."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise ValueError(f"{path} exists and is not a socket; remove it or choose another "
                         "--socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(2.0)
    try:
        probe.connect(str(path))
    except ConnectionRefusedError:
        if remove_stale:
            path.unlink(missing_ok=True)  # stale: its server is gone
        return
    except OSError as exc:
        raise ValueError(f"cannot tell whether {path} is in use ({exc.strerror or exc}); "
                         "remove it or choose another --socket") from None
    finally:
        probe.close()
    raise ValueError(f"another process is listening on {path}; stop it or choose another "
                     "--socket")


def check_private_folder(folder: Path) -> None:
    """Refuse a socket folder other users can enter (or that another user owns): the
    socket must be reachable by its owner only. A missing folder passes (it is made
    0700). The folder's mode is the operator's to change, not ours."""
    try:
        st = folder.stat()
    except FileNotFoundError:
        return
    if st.st_uid != os.getuid():
        raise ValueError(f"{folder} belongs to another user (uid {st.st_uid}); the socket "
                         "needs a folder of your own: choose another --socket")
    if st.st_mode & 0o011:
        raise ValueError(f"other users can enter {folder} (mode "
                         f"{stat.S_IMODE(st.st_mode):04o}); the socket needs a folder only "
                         f"you can enter: chmod 700 {folder}, or choose another --socket")


class OwnedSocket:
    """The unix socket at ``path``: :meth:`check` (changes nothing), :meth:`bind` to a
    gRPC server, :meth:`remove` at shutdown."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._bind_path = path.with_name(f".kv{os.getpid()}-{next(_bind_serial)}")
        self._id: tuple[int, int] | None = None  # (dev, inode) of the socket made here
        if max(len(str(path)), len(str(self._bind_path))) > MAX_SOCKET_PATH:
            raise ValueError(f"socket path is too long: {path} (a unix socket path and its "
                             f"temporary name .kv<pid> fit in {MAX_SOCKET_PATH} bytes; pass "
                             "a shorter --socket)")

    @property
    def address(self) -> str:
        return f"unix:{self.path}"

    def check(self) -> None:
        check_private_folder(self.path.parent)
        claim_socket_path(self.path, remove_stale=False)

    def bind(self, server: grpc.Server) -> None:
        """Bind ``server`` (not yet started) to the socket, owner-only."""
        make_private_dirs(self.path.parent)
        check_private_folder(self.path.parent)
        claim_socket_path(self.path)
        old_umask = os.umask(0o077)  # the socket file is created owner-only
        try:
            server.add_insecure_port(f"unix:{self._bind_path}")
        finally:
            os.umask(old_umask)
        try:
            os.chmod(self._bind_path, 0o600)
            os.link(self._bind_path, self.path)
        except FileExistsError:
            raise ValueError(f"{self.path} was taken by another process while this server "
                             "started; choose another --socket") from None
        finally:
            self._bind_path.unlink(missing_ok=True)
        self._id = file_id(self.path)

    def remove(self) -> None:
        """Remove the socket, if the path still holds the one made here."""
        if self._id is not None and file_id(self.path) == self._id:
            self.path.unlink(missing_ok=True)

"""One rule for every secret kvcache reads from a file (a token file, the shared tier's
signing key and password, the tenant secret): the file must be its owner's alone (mode
0600 or 0400, no bit for group or others), or it is refused with a message naming the
file and the ``chmod`` that fixes it. A secret others can read is no longer a secret,
and one others can write is not the operator's. tests/daemon/test_secret_files.py holds it for
each kind of file.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


class SecretFileError(ValueError):
    """A secret file that cannot be used: missing, unreadable or open to other users."""


def check_owner_only(path: Path, mode: int, what: str) -> None:
    """Refuse ``mode`` of ``path`` when group or others have any access to it."""
    if stat.S_IMODE(mode) & 0o077:
        raise SecretFileError(f"{what} {path} is accessible to other users (mode "
                              f"{stat.S_IMODE(mode):04o}): chmod 600 {path}")


def read_secret_file(path: str | Path, what: str) -> bytes:
    """The bytes of the secret file ``path`` (``what`` names it in errors), which must be
    owner-only; checked on the open file, so a file swapped after the check is not read."""
    p = Path(path).expanduser()
    try:
        with open(p, "rb") as f:
            check_owner_only(p, os.fstat(f.fileno()).st_mode, what)
            return f.read()
    except OSError as exc:
        raise SecretFileError(f"cannot read {what} {p}: {exc.strerror}") from None

"""One rule for every secret file (kvcache.secrets): owner-only (0600 or 0400), or refused
at start-up with a message naming the file and the chmod that fixes it, before the data
directory is touched. Each kind of file the daemon reads is tried through ``kvcache
serve``: the token file, the shared tier's signing key and password file, the tenant
secret file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvcache.auth import read_token, read_token_table
from kvcache.remote import RemoteConfig, load_signing_key
from kvcache.tenancy import load_secret_file

SECRET = "0123456789abcdef0123456789abcdef"
UNREACHABLE = "redis://127.0.0.1:1/0"  # never connected: every refusal comes first
OPTIONS = {
    "token file": ["--listen", "127.0.0.1:0", "--token-file", "{file}"],
    "remote signing key file": ["--remote", UNREACHABLE, "--remote-signing-key-file", "{file}"],
    "remote password file": ["--remote", UNREACHABLE, "--remote-unsigned",
                             "--remote-password-file", "{file}"],
    "tenant secret file": ["--tenant-secret-file", "{file}"],
}


def secret_file(path: Path, mode: int) -> Path:
    path.write_text(SECRET + "\n")
    path.chmod(mode)
    return path


@pytest.mark.parametrize("mode", [0o640, 0o660, 0o604],
                         ids=lambda m: f"{m:04o}")
@pytest.mark.parametrize("what", sorted(OPTIONS))
def test_a_secret_file_others_can_reach_is_refused(tmp_path: Path, what: str,
                                                   mode: int) -> None:
    f = secret_file(tmp_path / "secret", mode)
    args = [a.format(file=f) for a in OPTIONS[what]]
    data = tmp_path / "data"
    done = subprocess.run([sys.executable, "-m", "kvcache.cli", "serve", "--dir", str(data),
                           *args], capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL)
    assert done.returncode != 0
    assert f"{what} {f} is accessible to other users (mode {mode:04o}): chmod 600 {f}" \
        in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert not data.exists(), "it created its data directory anyway"


@pytest.mark.parametrize("mode", [0o600, 0o400])
def test_owner_only_secret_files_are_read(tmp_path: Path, mode: int) -> None:
    f = secret_file(tmp_path / "secret", mode)
    assert read_token(f) == SECRET
    assert list(read_token_table(f)) == [SECRET]
    assert load_signing_key(f) == SECRET.encode()
    assert RemoteConfig(UNREACHABLE, password_file=f).password() == SECRET
    assert load_secret_file(f) == SECRET.encode()
    os.chmod(f, 0o600)  # removable by the test's clean-up either way

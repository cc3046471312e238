"""kvcache touches only what it made and marked: data directory, RAM tier, socket.

Each rule is provoked against a real daemon process or the real command line: a folder
or file that is not kvcache's is refused or left alone (contents and mode unchanged), one
that is (or was made by an earlier version) is used; orphaned RAM tiers are found and
removed, live and foreign ones are not. And the suite's own leftovers check is shown to
fail a run that leaks.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from harness.payloads import payload_for
from harness.procs import REPO
from harness.procs import Gateway as GatewayProcess

from kvcache.cli import main as kvcache_main
from kvcache.config import ENV_DIR, parse_listen
from kvcache.store.ownership import DATA_MARKER
from kvcache.store.ramtier import RAM_MARKER, RAM_MARKER_WHAT, SHM, tier_dir, tier_name
from model_runtime.cli import RUNTIME_SOCKET
from model_runtime.gateway.apis.responses.store import ResponseStore
from model_runtime.gateway.settings import ResponsesSettings
from model_runtime.identity import model_fingerprint
from tests.support.daemon_proc import DaemonProcess, wait_for
from tests.support.entries import IDENT, toks


def kvcache_cli(*args: str, env: dict[str, str] | None = None
                ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvcache.cli", *args], capture_output=True,
                          text=True, timeout=60, env={**os.environ, **(env or {})})


def serve_refused(*args: str) -> subprocess.CompletedProcess[str]:
    """``kvcache serve`` that must refuse to start (a start would hang the test: bounded)."""
    out = kvcache_cli("serve", "--min-free-bytes", "0", *args)
    assert out.returncode != 0, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    return out


def snapshot(root: Path) -> dict[str, tuple[int, bytes | None]]:
    """Every path under ``root`` with its mode and (for files) bytes."""
    found = {".": (root.stat().st_mode, None)}
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        data = path.read_bytes() if stat.S_ISREG(st.st_mode) else None
        found[str(path.relative_to(root))] = (st.st_mode, data)
    return found


def foreign_folder(path: Path) -> Path:
    """A folder of someone else's: files, a subfolder, mode 755."""
    path.mkdir()
    (path / "notes.txt").write_text("mine")
    (path / "sub").mkdir()
    (path / "sub" / "deep.bin").write_bytes(b"\x00" * 10)
    path.chmod(0o755)
    return path


def save_in_ram(d: DaemonProcess, seed: int) -> bytes:
    tokens = toks(seed, 40)
    with d.client() as c:
        key = c.save(IDENT, tokens, payload_for(tokens, 50_000), "cold").key
        wait_for(lambda: key in {e.key for e in c.list_entries(tier="ram")},
                 "the entry placed in the RAM tier")
    return key


@pytest.fixture
def daemons() -> Iterator[Callable[..., DaemonProcess]]:
    """Daemons with a chosen RAM parent; all killed and their tiers removed after."""
    made: list[DaemonProcess] = []

    def make(data_dir: Path, ram_parent: Path | None = None, *args: str) -> DaemonProcess:
        d = DaemonProcess(data_dir, *args, ram_parent=ram_parent)
        made.append(d)
        return d

    yield make
    for d in made:
        d.close()


# -- the RAM tier ---------------------------------------------------------------------------


def test_ram_dir_with_foreign_files_is_left_alone(
        tmp_path: Path, daemons: Callable[..., DaemonProcess]) -> None:
    """--ram-dir names a folder holding other files and a subfolder: the daemon starts in
    its own subfolder of it and changes nothing else, not even the folder's mode."""
    parent = foreign_folder(tmp_path / "shared")
    before = snapshot(parent)
    d = daemons(tmp_path / "data", parent).start()
    key = save_in_ram(d, 1)
    with d.client() as c:
        ram = next(t for t in c.stats().tiers if t.directory != str(d.data_dir))
    assert ram.directory == str(parent / tier_name(tmp_path / "data")) == str(d.ram_dir)
    assert (d.ram_dir / f"{key.hex()}.kvc").is_file()
    d.stop()
    after = snapshot(parent)
    assert {k: v for k, v in after.items() if not k.startswith(d.ram_dir.name)} == before
    assert stat.S_IMODE(d.ram_dir.stat().st_mode) == 0o700


def test_foreign_names_inside_our_folders_are_left_and_start_up_goes_on(
        tmp_path: Path, daemons: Callable[..., DaemonProcess]) -> None:
    """Start-up sweeps only kvcache's own names in its tier; a stray file or subfolder
    there is logged and left (it used to be deleted, and a subfolder failed start-up)."""
    d = daemons(tmp_path / "data", tmp_path / "ram").start()
    key = save_in_ram(d, 2)
    d.stop()
    (d.ram_dir / "stray.txt").write_text("not kvcache's")
    (d.ram_dir / "subfolder").mkdir()
    (d.ram_dir / f"{'ab' * 16}.part").write_bytes(b"a copy cut short")  # ours: swept
    (d.data_dir / "tmp" / "keep").mkdir()  # a subfolder in the temp folder failed start-up
    d.start()
    assert (d.data_dir / "tmp" / "keep").is_dir()
    assert (d.ram_dir / "stray.txt").read_text() == "not kvcache's"
    assert (d.ram_dir / "subfolder").is_dir()
    assert not (d.ram_dir / f"{'ab' * 16}.part").exists()
    assert "left alone in the RAM tier" in d.log() and "stray.txt" in d.log()
    with d.client() as c:
        assert c.load(key).tier == "ram"


def test_a_tier_folder_of_another_data_dir_is_refused(tmp_path: Path) -> None:
    parent = tmp_path / "ram"
    tier = parent / tier_name(tmp_path / "data")
    tier.mkdir(parents=True, mode=0o700)
    (tier / RAM_MARKER).write_text(json.dumps({"format": 1, "data_dir": "/somewhere/else"}))
    (tier / f"{'cd' * 16}.kvc").write_bytes(b"someone's copy")
    before = snapshot(parent)
    out = serve_refused("--dir", str(tmp_path / "data"), "--ram-dir", str(parent),
                        "--socket", str(tmp_path / "s.sock"))
    assert out.returncode == 1
    assert "is the RAM tier of /somewhere/else" in out.stderr
    assert snapshot(parent) == before


def test_default_ram_tier_is_its_own_folder_in_dev_shm(tmp_path: Path) -> None:
    """Without --ram-dir the tier is /dev/shm/kvcache-<uid>-<tag>, which `kvcache stats`
    reports; the test removes it (a tier outlives its daemon on purpose)."""
    if not SHM.is_dir():
        pytest.skip("no /dev/shm here")
    data = tmp_path / "data"
    sock = tmp_path / "s.sock"
    proc = subprocess.Popen([sys.executable, "-m", "kvcache.cli", "serve", "--dir", str(data),
                             "--socket", str(sock), "--min-free-bytes", "0"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    tier = tier_dir(data)
    try:
        wait_for(lambda: sock.exists(), "the daemon's socket")
        out = kvcache_cli("stats", "--json", "-a", str(sock))
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["tiers"]["ram"]["directory"] == str(tier)
        assert tier.parent == SHM and tier.is_dir()
        assert json.loads((tier / RAM_MARKER).read_text())["data_dir"] == str(data.resolve())
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        for path in tier.iterdir():
            path.unlink()
        tier.rmdir()


# -- the data directory ---------------------------------------------------------------------


def test_a_foreign_non_empty_dir_is_refused_untouched(tmp_path: Path) -> None:
    folder = foreign_folder(tmp_path / "photos")
    before = snapshot(folder)
    out = serve_refused("--dir", str(folder), "--ram-dir", str(tmp_path / "ram"))
    assert out.returncode == 1
    assert "is not empty and is not a kvcache data directory" in out.stderr
    assert "choose a new or empty directory" in out.stderr
    assert snapshot(folder) == before
    assert not (tmp_path / "ram").exists()


def test_a_file_named_like_the_marker_does_not_make_a_folder_ours(tmp_path: Path) -> None:
    from kvcache.store.ownership import NotOwned, claim_data_dir

    folder = foreign_folder(tmp_path / "notes")
    (folder / DATA_MARKER).write_text("someone else's file\n")
    before = snapshot(folder)
    with pytest.raises(NotOwned, match="is not a kvcache data directory"):
        claim_data_dir(folder)
    assert snapshot(folder) == before
    # A marker write cut short in a folder kvcache made leaves only its temp file: ours.
    made = tmp_path / "made"
    made.mkdir()
    (made / f"{DATA_MARKER}.123.tmp").write_text("{")
    claim_data_dir(made)
    assert (made / DATA_MARKER).is_file()


def test_an_existing_empty_dir_is_used_without_changing_its_mode(
        tmp_path: Path, daemons: Callable[..., DaemonProcess]) -> None:
    data = tmp_path / "data"
    data.mkdir(mode=0o755)
    data.chmod(0o755)
    d = daemons(data).start()
    save_in_ram(d, 3)
    assert stat.S_IMODE(data.stat().st_mode) == 0o755
    assert (data / DATA_MARKER).is_file()
    for sub in ("blobs", "tmp", "quarantine", "index"):
        assert stat.S_IMODE((data / sub).stat().st_mode) == 0o700, sub


def test_a_new_dir_is_made_owner_only_and_marked(tmp_path: Path,
                                                 daemons: Callable[..., DaemonProcess]) -> None:
    d = daemons(tmp_path / "data").start()
    assert stat.S_IMODE(d.data_dir.stat().st_mode) == 0o700
    assert json.loads((d.data_dir / DATA_MARKER).read_text())["format"] == 1


def test_a_data_dir_of_an_earlier_version_is_adopted(
        tmp_path: Path, daemons: Callable[..., DaemonProcess]) -> None:
    """A data dir and RAM tier made before markers existed (same layout, no marker, and
    a file of the operator's beside them) are used, entries and all, and get marked."""
    d = daemons(tmp_path / "data", tmp_path / "ram").start()
    key = save_in_ram(d, 4)
    d.stop()
    (d.data_dir / DATA_MARKER).unlink()
    (d.ram_dir / RAM_MARKER).unlink()
    (d.data_dir / "README.txt").write_text("the operator's note")
    d.start()
    with d.client() as c:
        assert c.load(key).tier == "ram"
    assert (d.data_dir / DATA_MARKER).is_file() and (d.ram_dir / RAM_MARKER).is_file()
    assert (d.data_dir / "README.txt").read_text() == "the operator's note"


def test_a_dir_holding_only_the_fingerprint_memo_is_used(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        daemons: Callable[..., DaemonProcess]) -> None:
    """The runtime remembers model fingerprints in KVCACHE_DIR, perhaps before any daemon
    ran there: that file does not make the folder foreign. (It used to go to
    ~/.cache/kvcache whatever KVCACHE_DIR said.)"""
    data = tmp_path / "kv"
    monkeypatch.setenv(ENV_DIR, str(data))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    model = tmp_path / "model.bin"
    model.write_bytes(b"weights" * 1000)
    fingerprint = model_fingerprint(model)
    memo = json.loads((data / "fingerprints.json").read_text())
    assert memo[str(model.resolve())]["fingerprint"] == fingerprint
    assert not (tmp_path / "xdg").exists()
    daemons(data).start()


def test_a_dir_holding_only_the_gateway_s_stored_responses_is_used(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        daemons: Callable[..., DaemonProcess]) -> None:
    """A gateway run with --cache none keeps the Responses API's stored responses in the
    default folder; the daemon a later gateway starts there must not take it for a
    folder of someone else's (and must leave them alone)."""
    data = tmp_path / "kv"
    monkeypatch.setenv(ENV_DIR, str(data))
    store = ResponseStore(ResponsesSettings())
    assert store.count() == 0  # made on first use
    store.close()
    assert os.listdir(data) == ["gateway-responses"]
    daemons(data).start()
    assert os.listdir(data / "gateway-responses") == ["responses.sqlite3"]


def test_a_dir_holding_the_runtime_s_default_socket_is_used(
        tmp_path: Path, daemons: Callable[..., DaemonProcess]) -> None:
    """``model-runtime serve`` started first in a new home puts its socket in the default
    folder; ``kvcache serve`` started next must still take the folder."""
    data = tmp_path / "kv"
    data.mkdir(mode=0o700)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as runtime:
        runtime.bind(str(data / RUNTIME_SOCKET))
        runtime.listen()
        daemons(data).start()
    assert RUNTIME_SOCKET in os.listdir(data)


def cache_home_env(xdg: Path) -> dict[str, str]:
    """An environment whose default kvcache folder is ``xdg``/kvcache."""
    env = {k: v for k, v in os.environ.items() if k not in (ENV_DIR, "KVCACHE_ADDRESS")}
    return {**env, "XDG_CACHE_HOME": str(xdg)}


def test_the_runtime_and_the_gateway_make_the_default_folder_owner_only(
        tmp_path: Path, tiny_model: Path) -> None:
    """The folder README says holds the sockets in 0700 was made 0755 by the runtime's
    fingerprint memo (and then kept by kvcache serve)."""
    xdg = tmp_path / "runtime"
    out = subprocess.run([sys.executable, "-m", "model_runtime.cli", "complete", "--model",
                          str(tiny_model), "--cache", "none", "--threads", "1", "--n-ctx",
                          "256", "--prompt", "hi", "--max-tokens", "1"],
                         capture_output=True, text=True, timeout=120, env=cache_home_env(xdg))
    assert out.returncode == 0, out.stderr
    assert stat.S_IMODE((xdg / "kvcache").stat().st_mode) == 0o700
    assert (xdg / "kvcache" / "fingerprints.json").is_file()

    xdg = tmp_path / "gateway"
    gateway = GatewayProcess(tmp_path / "gateway.log", "--model", f"tiny={tiny_model}",
                             "--n-ctx", "256", env=cache_home_env(xdg))
    try:
        gateway.start()
        assert stat.S_IMODE((xdg / "kvcache").stat().st_mode) == 0o700
    finally:
        gateway.close()


def test_a_socket_folder_others_can_enter_is_refused(tmp_path: Path, tiny_model: Path) -> None:
    """Daemon and runtime alike; the folder's mode is left as it is, and nothing is made."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o755)
    out = serve_refused("--dir", str(tmp_path / "data"), "--ram-dir", str(tmp_path / "ram"),
                        "--socket", str(shared / "kv.sock"))
    assert out.returncode == 1
    assert f"other users can enter {shared} (mode 0755); the socket needs a folder only you " \
           f"can enter: chmod 700 {shared}, or choose another --socket" in out.stderr
    assert not (tmp_path / "data").exists() and not (tmp_path / "ram").exists()
    assert os.listdir(shared) == []
    out = runtime_serve_refused(tiny_model, shared / "rt.sock")
    assert f"other users can enter {shared} (mode 0755)" in out.stderr
    assert stat.S_IMODE(shared.stat().st_mode) == 0o755 and os.listdir(shared) == []

    # The default folder, as an earlier runtime left it (0755, its memo inside).
    xdg = tmp_path / "xdg"
    (xdg / "kvcache").mkdir(parents=True)
    (xdg / "kvcache").chmod(0o755)
    (xdg / "kvcache" / "fingerprints.json").write_text("{}")
    out = subprocess.run([sys.executable, "-m", "kvcache.cli", "serve", "--min-free-bytes",
                          "0", "--ram-dir", str(tmp_path / "ram")], capture_output=True,
                         text=True, timeout=60, env=cache_home_env(xdg))
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert f"chmod 700 {xdg / 'kvcache'}" in out.stderr
    assert os.listdir(xdg / "kvcache") == ["fingerprints.json"]
    assert not (tmp_path / "ram").exists()


def test_an_empty_path_option_is_a_usage_error(tmp_path: Path) -> None:
    for option in ("--dir", "--socket", "--ram-dir"):
        out = kvcache_cli("serve", option, "", "--dir" if option != "--dir" else "--socket",
                          str(tmp_path / "x"))
        assert out.returncode == 2, (option, out.stderr)
        assert f"Invalid value for '{option}': must not be empty" in out.stderr
    assert os.listdir(tmp_path) == []


# -- the socket -----------------------------------------------------------------------------


def test_a_regular_file_at_the_socket_path_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "important.txt"
    path.write_text("do not replace me")
    out = serve_refused("--dir", str(tmp_path / "data"), "--socket", str(path))
    assert out.returncode == 1
    assert f"{path} exists and is not a socket; remove it or choose another --socket" \
        in out.stderr
    assert path.read_text() == "do not replace me"
    assert not (tmp_path / "data").exists()


def test_a_live_daemons_socket_is_refused(tmp_path: Path,
                                          daemons: Callable[..., DaemonProcess]) -> None:
    first = daemons(tmp_path / "first").start()
    inode = first.socket.stat().st_ino
    out = serve_refused("--dir", str(tmp_path / "second"), "--ram-dir", str(tmp_path / "ram2"),
                        "--socket", str(first.socket))
    assert out.returncode == 1
    assert f"another process is listening on {first.socket}" in out.stderr
    assert first.socket.stat().st_ino == inode
    assert not (tmp_path / "second").exists() and not (tmp_path / "ram2").exists()
    with first.client(timeout=5.0) as c:
        assert c.stats().tiers[1].directory == str(first.data_dir)
    assert first.proc is not None and first.proc.poll() is None


def runtime_serve_refused(model: Path, socket_path: Path) -> subprocess.CompletedProcess[str]:
    """``model-runtime serve`` that must refuse its socket path (bounded: a start hangs)."""
    out = subprocess.run([sys.executable, "-m", "model_runtime.cli", "serve", "--model",
                          str(model), "--cache", "none", "--threads", "1", "--socket",
                          str(socket_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    return out


def test_the_runtime_refuses_a_socket_path_it_does_not_own(
        tmp_path: Path, tiny_model: Path, daemons: Callable[..., DaemonProcess]) -> None:
    path = tmp_path / "important.txt"
    path.write_text("do not replace me")
    out = runtime_serve_refused(tiny_model, path)
    assert f"{path} exists and is not a socket" in out.stderr
    assert path.read_text() == "do not replace me"
    live = daemons(tmp_path / "live").start()
    inode = live.socket.stat().st_ino
    out = runtime_serve_refused(tiny_model, live.socket)
    assert f"another process is listening on {live.socket}" in out.stderr
    assert live.socket.stat().st_ino == inode
    with live.client(timeout=5.0) as c:
        c.stats()  # still serving on its socket


def test_a_stale_socket_is_replaced_and_removed_at_shutdown(
        tmp_path: Path, daemons: Callable[..., DaemonProcess]) -> None:
    d = daemons(tmp_path / "data")
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(d.socket))
    stale.close()  # the file stays, nobody listens: a daemon that died
    d.start()
    with d.client() as c:
        c.stats()
    d.stop()
    assert not d.socket.exists()


def test_shutdown_leaves_a_socket_that_took_its_path(
        tmp_path: Path, daemons: Callable[..., DaemonProcess]) -> None:
    """The path was taken over while the daemon ran: at shutdown that socket is not the
    daemon's to remove (gRPC itself would remove whatever is at the path it bound)."""
    d = daemons(tmp_path / "data").start()
    d.socket.unlink()
    other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        other.bind(str(d.socket))
        other.listen()
        inode = d.socket.stat().st_ino
        assert d.stop() == 0
        assert d.socket.stat().st_ino == inode
    finally:
        other.close()
        d.socket.unlink(missing_ok=True)


# -- --listen -------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["127.0.0.1:99999", "127.0.0.1:-1", "127.0.0.1:", ":8080",
                                  "8080", "::1:8080", "[::1:8080", "[]:80", "host:8o"])
def test_parse_listen_refuses(text: str) -> None:
    with pytest.raises(ValueError):
        parse_listen(text)


def test_parse_listen_accepts() -> None:
    assert parse_listen("127.0.0.1:0") == ("127.0.0.1", 0)
    assert parse_listen("localhost:65535") == ("localhost", 65535)
    assert parse_listen("[::1]:50051") == ("[::1]", 50051)


@pytest.mark.parametrize("command", [["kvcache.cli", "serve"],
                                     ["model_runtime.cli", "serve"]])
def test_listen_port_out_of_range_is_a_usage_error(tmp_path: Path, command: list[str]) -> None:
    """gRPC took 99999 modulo 65536 and listened on port 34463."""
    out = subprocess.run([sys.executable, "-m", *command, "--listen", "127.0.0.1:99999",
                          "--insecure-tcp"], capture_output=True, text=True, timeout=60,
                         cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert "the port must be a number from 0 to 65535" in out.stderr
    assert os.listdir(tmp_path) == []


def test_library_daemon_refuses_a_bad_listen_address(tmp_path: Path) -> None:
    from kvcache.server import Daemon
    from kvcache.store import StoreConfig

    with pytest.raises(ValueError, match="from 0 to 65535"):
        Daemon(StoreConfig(root=tmp_path / "data"), listen="127.0.0.1:99999", insecure_tcp=True)
    assert os.listdir(tmp_path) == []


# -- kvcache ram-tiers ----------------------------------------------------------------------


def ram_tiers(*args: str) -> tuple[int, dict[str, object]]:
    result = CliRunner().invoke(kvcache_main, ["ram-tiers", "--json", *args])
    return result.exit_code, json.loads(result.output)


def test_ram_tiers_removes_orphans_only(tmp_path: Path,
                                        daemons: Callable[..., DaemonProcess]) -> None:
    parent = tmp_path / "shm"
    live = daemons(tmp_path / "live", parent).start()
    save_in_ram(live, 5)
    idle = daemons(tmp_path / "idle", parent).start()
    idle.stop()
    gone = daemons(tmp_path / "gone", parent).start()
    save_in_ram(gone, 6)
    gone.stop()
    subprocess.run(["rm", "-rf", str(gone.data_dir)], check=True)
    foreign = parent / f"kvcache-{os.getuid()}-notours"
    foreign.mkdir()
    (foreign / f"{'ef' * 16}.kvc").write_bytes(b"no marker: not removable")
    # A well-formed marker that does not say kvcache made the folder: not kvcache's.
    imitation = orphan_tier(parent, tmp_path / "elsewhere", what="another tool's cache")
    status, listed = ram_tiers("--parent", str(parent))
    assert status == 0
    states = {t["path"]: t["state"] for t in listed["tiers"]}  # type: ignore[attr-defined]
    assert states == {str(live.ram_dir): "in_use", str(idle.ram_dir): "idle",
                      str(gone.ram_dir): "orphan", str(foreign): "unmarked",
                      str(imitation): "unmarked"}
    orphan = next(t for t in listed["tiers"] if t["state"] == "orphan")  # type: ignore[attr-defined]
    assert orphan["data_dir"] == str(gone.data_dir) and orphan["bytes"] > 50_000

    status, done = ram_tiers("--parent", str(parent), "--remove-orphans")
    assert status == 0 and done["removed"] == [str(gone.ram_dir)] and done["kept"] == {}
    assert not gone.ram_dir.exists()
    assert live.ram_dir.is_dir() and idle.ram_dir.is_dir() and foreign.is_dir()
    assert imitation.is_dir()
    with live.client() as c:
        assert c.list_entries(tier="ram")
    result = CliRunner().invoke(kvcache_main, ["ram-tiers", "--parent", str(parent),
                                               "--remove", str(imitation)])
    assert result.exit_code == 2 and imitation.is_dir()
    assert "it has no marker saying kvcache made it" in result.output


def test_ram_tiers_removes_one_named_orphan(tmp_path: Path) -> None:
    """An operator removes one tier by its name or path; another orphan (perhaps another
    project's) stays. A tier that is no orphan, or none at all, is a usage error and
    nothing is removed."""
    parent = tmp_path / "shm"
    mine = orphan_tier(parent, tmp_path / "my-data")
    theirs = orphan_tier(parent, tmp_path / "their-data")
    idle_data = tmp_path / "idle-data"
    idle_data.mkdir()
    idle = orphan_tier(parent, idle_data)
    for name in (str(idle), "kvcache-nonesuch", str(tmp_path)):
        result = CliRunner().invoke(kvcache_main, ["ram-tiers", "--parent", str(parent),
                                                   "--remove", name])
        assert result.exit_code == 2, result.output
    assert "only a tier whose data directory is gone is removed" in CliRunner().invoke(
        kvcache_main, ["ram-tiers", "--parent", str(parent), "--remove", idle.name]).output
    assert {p.name for p in parent.iterdir()} == {mine.name, theirs.name, idle.name}

    status, done = ram_tiers("--parent", str(parent), "--remove", mine.name)
    assert status == 0 and done["removed"] == [str(mine)] and done["kept"] == {}
    assert {p.name for p in parent.iterdir()} == {theirs.name, idle.name}
    result = CliRunner().invoke(kvcache_main, ["ram-tiers", "--parent", str(parent),
                                               "--remove", str(theirs), "--remove-orphans"])
    assert result.exit_code == 2 and theirs.is_dir()


def test_ram_tiers_lists_what_goes_and_asks_on_a_terminal(tmp_path: Path) -> None:
    from tests.support.commands import on_terminal

    parent = tmp_path / "shm"
    first = orphan_tier(parent, tmp_path / "first-data")
    second = orphan_tier(parent, tmp_path / "second-data")
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    args = ("ram-tiers", "--parent", str(parent), "--remove-orphans")
    code, shown = on_terminal(env, *args, columns=300, answer="n")
    assert code == 1, shown
    assert "ram-tiers will remove 2 RAM tier(s)" in shown and "Go ahead? [y/N]" in shown
    for tier, data in ((first, "first-data"), (second, "second-data")):
        assert f"  {tier} (" in shown and f"its data directory {tmp_path / data} is gone" \
            in shown
    assert "cancelled; nothing was changed" in shown
    assert first.is_dir() and second.is_dir()

    code, shown = on_terminal(env, "ram-tiers", "--parent", str(parent), "--remove",
                              first.name, columns=300, answer="y")
    assert code == 0 and "ram-tiers will remove 1 RAM tier(s)" in shown, shown
    assert not first.exists() and second.is_dir()
    code, shown = on_terminal(env, *args, "--yes", columns=300)
    assert code == 0 and "[y/N]" not in shown and "removed 1 orphaned" in shown, shown
    assert os.listdir(parent) == []


def test_ram_tiers_table_never_cuts_a_tier_at_80_columns(tmp_path: Path) -> None:
    """Its path is what --remove takes back: it used to be cut with an ellipsis."""
    from tests.support.commands import on_terminal

    parent = tmp_path / "a-rather-long-folder-name-for-ram-tiers"
    tiers = [orphan_tier(parent, tmp_path / f"data-{i}") for i in range(2)]
    idle_data = tmp_path / "a-data-directory-with-a-long-name-that-must-fold"
    idle_data.mkdir()
    tiers.append(orphan_tier(parent, idle_data))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    code, shown = on_terminal(env, "ram-tiers", "--parent", str(parent), columns=80)
    assert code == 0, shown
    assert "…" not in shown
    lines = shown.splitlines()
    for tier in tiers:
        assert any(line.startswith(f"{tier} ") for line in lines), shown
    # Nothing of a data directory is dropped either: it folds onto the next lines.
    assert str(idle_data) not in shown and str(idle_data) in "".join(shown.split())


def orphan_tier(parent: Path, data_dir: Path, what: str = RAM_MARKER_WHAT) -> Path:
    """A RAM tier whose data directory is gone, with one copy in it, as a daemon leaves it
    (``what``: what its marker says it is)."""
    tier = parent / tier_name(data_dir)
    tier.mkdir(parents=True, mode=0o700)
    (tier / RAM_MARKER).write_text(json.dumps({"what": what, "data_dir": str(data_dir),
                                               "format": 1}))
    (tier / f"{'01' * 16}.kvc").write_bytes(b"a copy")
    return tier


def test_ram_tiers_keeps_an_orphan_holding_foreign_files(tmp_path: Path) -> None:
    parent = tmp_path / "shm"
    tier = orphan_tier(parent, tmp_path / "deleted-data")
    (tier / "diary.txt").write_text("not ours")
    before = snapshot(parent)
    status, done = ram_tiers("--parent", str(parent), "--remove-orphans")
    assert status == 1
    assert done["removed"] == [] and "1 entries kvcache did not make" in \
        done["kept"][str(tier)]  # type: ignore[index]
    assert snapshot(parent) == before


def test_ram_tiers_table(tmp_path: Path, daemons: Callable[..., DaemonProcess]) -> None:
    parent = tmp_path / "shm"
    gone = daemons(tmp_path / "gone", parent).start()
    gone.stop()
    subprocess.run(["rm", "-rf", str(gone.data_dir)], check=True)
    env = {"COLUMNS": "300"}
    listed = kvcache_cli("ram-tiers", "--parent", str(parent), env=env)
    assert listed.returncode == 0, listed.stderr
    assert "orphan" in listed.stdout and "kvcache ram-tiers --remove-orphans" in listed.stdout
    removed = kvcache_cli("ram-tiers", "--parent", str(parent), "--remove-orphans", env=env)
    assert removed.returncode == 0, removed.stderr
    assert "removed 1 orphaned RAM tier(s)" in removed.stdout
    assert os.listdir(parent) == []


# -- the suite's leftovers check ------------------------------------------------------------

LEAKY_TEST = '''
import os, subprocess, sys
from pathlib import Path

def test_leaks():
    folder = Path("/dev/shm") / f"kvcache-{os.getuid()}-leaktest{os.getpid()}"
    folder.mkdir()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    Path(os.environ["LEAK_REPORT"]).write_text(f"{folder}\\n{child.pid}")
'''

TIDY_TEST = '''
import os, subprocess, sys, shutil
from pathlib import Path

def test_cleans_up():
    folder = Path("/dev/shm") / f"kvcache-{os.getuid()}-tidytest{os.getpid()}"
    folder.mkdir()
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    folder.rmdir()
'''


def run_sub_session(tmp_path: Path, test_source: str) -> subprocess.CompletedProcess[str]:
    """A pytest run of its own with the suite's leftovers hooks."""
    (tmp_path / "conftest.py").write_text(textwrap.dedent('''
        from tests.support.leftovers import check, record

        def pytest_sessionstart(session):
            record(session)

        def pytest_sessionfinish(session, exitstatus):
            check(session)
        '''))
    (tmp_path / "test_sub.py").write_text(test_source)
    env = {**os.environ, "LEAK_REPORT": str(tmp_path / "leak.txt"),
           "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), str(tmp_path / "test_sub.py")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)


def test_the_leftovers_check_fails_a_run_that_leaks(tmp_path: Path) -> None:
    if not SHM.is_dir():
        pytest.skip("no /dev/shm here")
    out = run_sub_session(tmp_path, LEAKY_TEST)
    folder, pid = (tmp_path / "leak.txt").read_text().split("\n")
    try:
        assert out.returncode == 1, out.stdout + out.stderr
        assert "1 passed" in out.stdout
        assert f"RAM-tier folder left in /dev/shm: {folder}" in out.stdout
        assert f"process still running: pid {pid}:" in out.stdout
    finally:
        os.kill(int(pid), signal.SIGKILL)
        Path(folder).rmdir()
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.02)  # reaped by init, not by us: it was the sub-session's child


def test_the_leftovers_check_passes_a_tidy_run(tmp_path: Path) -> None:
    if not SHM.is_dir():
        pytest.skip("no /dev/shm here")
    out = run_sub_session(tmp_path, TIDY_TEST)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "LEFTOVERS" not in out.stdout

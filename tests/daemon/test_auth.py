"""Access control on TCP, against real daemons: a shared token, TLS, mutual TLS.

The unix socket stays private by file permissions (tests/daemon/test_daemon.py checks the modes);
these tests are about the TCP listener, which must never serve an unauthenticated caller
unless it was started with --insecure-tcp.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import trustme
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvcache.auth import AuthConfigError, ClientAuth, ServerAuth, read_token
from kvcache.client import CacheClient, CacheError, CacheUnavailable, Identity
from tests.support.daemon_proc import (
    TOKEN,
    tcp_address,
    wait_for,
    write_token,
)
from tests.support.entries import DaemonFactory

IDENT = Identity("fp-auth", {"type_k": "f16"}, model_name="m")


def round_trip(client: CacheClient, n: int) -> None:
    tokens = list(range(1, n + 1))
    payload = bytes(range(256)) * 40
    saved = client.save(IDENT, tokens, payload, "cold")
    assert not client.fast_path, "a TCP client must stream"
    assert bytes(client.load(saved.key).payload) == payload


def status_of(fn: Callable[[], object]) -> CacheError:
    return pytest.raises(CacheError, fn).value


def kvcache_cli(*args: str, env: dict[str, str] | None = None,
                timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvcache.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A CA with a server certificate for 127.0.0.1 and a client certificate, and a second
    CA whose client certificate the daemon must refuse."""
    d = tmp_path_factory.mktemp("pki")
    ca, rogue_ca = trustme.CA(), trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("runtime-1.example")
    rogue = rogue_ca.issue_cert("intruder.example")
    files = {"ca": d / "ca.pem", "server_cert": d / "server.pem", "server_key": d / "server.key",
             "client_cert": d / "client.pem", "client_key": d / "client.key",
             "rogue_cert": d / "rogue.pem", "rogue_key": d / "rogue.key"}
    ca.cert_pem.write_to_path(str(files["ca"]))
    for name, issued in (("server", server), ("client", client), ("rogue", rogue)):
        files[f"{name}_cert"].write_bytes(b"".join(b.bytes() for b in issued.cert_chain_pems))
        issued.private_key_pem.write_to_path(str(files[f"{name}_key"]))
    return files


# -- refusing to start --------------------------------------------------------------------


@pytest.mark.parametrize("args, message", [
    (["--listen", "127.0.0.1:0"], "refusing to listen on TCP"),
    (["--listen", "127.0.0.1:0", "--tls-cert", "{server_cert}", "--tls-key", "{server_key}"],
     "refusing to listen on TCP"),  # TLS alone encrypts, but lets anyone in
    (["--token-file", "{token}"], "give --listen"),
    (["--listen", "127.0.0.1:0", "--tls-cert", "{server_cert}"], "go together"),
    (["--listen", "127.0.0.1:0", "--tls-client-ca", "{ca}"], "needs --tls-cert"),
    (["--listen", "127.0.0.1:0", "--token-file", "{loose_token}"], "chmod 600"),
    (["--listen", "127.0.0.1:0", "--token-file", "{short_token}"], "at least 16"),
    (["--listen", "127.0.0.1:0", "--token-file", "{missing}"], "cannot read token file"),
])
def test_daemon_refuses_tcp_it_cannot_protect(tmp_path: Path, pki: dict[str, Path],
                                              args: list[str], message: str) -> None:
    files = {**{k: str(v) for k, v in pki.items()},
             "token": str(write_token(tmp_path / "token")),
             "loose_token": str(write_token(tmp_path / "loose", mode=0o644)),
             "short_token": str(write_token(tmp_path / "short", "tooshort")),
             "missing": str(tmp_path / "nope")}
    out = kvcache_cli("serve", "--dir", str(tmp_path / "data"),
                      *(a.format(**files) for a in args))
    assert out.returncode != 0
    assert message in out.stderr, out.stderr
    assert not (tmp_path / "data").exists(), "it created its data directory anyway"


def test_library_daemon_refuses_unauthenticated_tcp(tmp_path: Path) -> None:
    from kvcache.server import Daemon
    from kvcache.store import StoreConfig

    with pytest.raises(AuthConfigError, match="--insecure-tcp"):
        Daemon(StoreConfig(root=tmp_path / "data"), listen="127.0.0.1:0")
    assert not (tmp_path / "data").exists()


def test_token_file_rules(tmp_path: Path) -> None:
    assert read_token(write_token(tmp_path / "t")) == TOKEN
    with pytest.raises(AuthConfigError, match="other users"):
        read_token(write_token(tmp_path / "g", mode=0o640))
    with pytest.raises(AuthConfigError, match="no spaces"):
        read_token(write_token(tmp_path / "s", "abcdefgh ijklmnopq"))
    with pytest.raises(AuthConfigError, match="go together"):
        ServerAuth.load(tls_key=tmp_path / "t")
    with pytest.raises(AuthConfigError, match="go together"):
        ClientAuth.load(tls_cert=tmp_path / "t")


# -- a shared token ---------------------------------------------------------------------


def test_token_guards_every_call_on_tcp(daemon_factory: DaemonFactory, tmp_path: Path) -> None:
    token_file = write_token(tmp_path / "token")
    d = daemon_factory("--listen", "127.0.0.1:0", "--token-file", str(token_file))
    address = tcp_address(d)
    assert "clear text" in d.log(), "a token without TLS must be logged as a warning"

    with CacheClient(address, auth=ClientAuth()) as anonymous:
        for call in (anonymous.stats, anonymous.list_entries,
                     lambda: anonymous.lookup(IDENT, [1, 2, 3]),
                     lambda: anonymous.save(IDENT, [1, 2, 3], b"x" * 100, "cold"),
                     lambda: anonymous.load(b"\0" * 16), lambda: list(anonymous.verify())):
            err = status_of(call)
            assert err.code == grpc.StatusCode.UNAUTHENTICATED, err
            assert "missing bearer token" in str(err)
        # Health answers without credentials (probes), and says nothing else.
        health = health_pb2_grpc.HealthStub(anonymous.channel)
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == \
            health_pb2.HealthCheckResponse.SERVING

    wrong = write_token(tmp_path / "wrong", "0" * len(TOKEN))
    with CacheClient(address, auth=ClientAuth.load(token_file=wrong)) as guesser:
        err = status_of(guesser.stats)
        assert err.code == grpc.StatusCode.UNAUTHENTICATED and "wrong bearer token" in str(err)

    with CacheClient(address, auth=ClientAuth.load(token_file=token_file)) as client:
        round_trip(client, 40)
        assert client.stats().tiers
    with d.client(auth=ClientAuth()) as local:  # the unix socket needs no token
        assert len(local.list_entries()) == 1


def test_cli_presents_the_token(daemon_factory: DaemonFactory, tmp_path: Path) -> None:
    token_file = write_token(tmp_path / "token")
    d = daemon_factory("--listen", "127.0.0.1:0", "--token-file", str(token_file))
    address = tcp_address(d)
    denied = kvcache_cli("stats", "--address", address, "--json")
    assert denied.returncode == 1
    assert "not authenticated" in denied.stderr and "bearer token" in denied.stderr
    by_option = kvcache_cli("stats", "--address", address, "--token-file", str(token_file),
                            "--json")
    assert by_option.returncode == 0, by_option.stderr
    assert '"counters"' in by_option.stdout
    by_env = kvcache_cli("stats", "--address", address, "--json",
                         env={"KVCACHE_TOKEN_FILE": str(token_file)})
    assert by_env.returncode == 0, by_env.stderr
    # Operator commands are the unix socket's unless the daemon says TCP callers are
    # operators too.
    listing = kvcache_cli("ls", "--address", address, "--token-file", str(token_file))
    assert listing.returncode == 1 and "permission denied" in listing.stderr, listing.stderr


OPERATOR_CALLS: dict[str, Callable[[CacheClient, bytes], object]] = {
    "List": lambda c, k: c.list_entries(),
    "Inspect": lambda c, k: c.inspect(k),
    "Verify": lambda c, k: list(c.verify()),
    "Prune": lambda c, k: c.prune(older_than_seconds=1.0),
    "Pin": lambda c, k: c.pin(k),
    "Unpin": lambda c, k: c.unpin(k),
}


@pytest.mark.parametrize("tcp_admin", [False, True], ids=["clients", "operators"])
def test_tcp_callers_are_clients_unless_the_daemon_says_operators(
        daemon_factory: DaemonFactory, tmp_path: Path, tcp_admin: bool) -> None:
    """A runtime's token must not let it list, inspect or prune every tenant's entries:
    on TCP those calls are refused unless the daemon runs with --tcp-admin."""
    token_file = write_token(tmp_path / "token")
    d = daemon_factory("--listen", "127.0.0.1:0", "--token-file", str(token_file),
                       *(["--tcp-admin"] if tcp_admin else []))
    with CacheClient(tcp_address(d), auth=ClientAuth.load(token_file=token_file)) as client:
        tokens = list(range(1, 41))
        saved = client.save(IDENT, tokens, b"z" * 500, "cold")  # the data path is open
        assert client.lookup(IDENT, tokens).key == saved.key
        assert bytes(client.load(saved.key).payload) == b"z" * 500
        assert client.stats().tiers
        for name, call in OPERATOR_CALLS.items():
            if tcp_admin:
                call(client, saved.key)
                continue
            err = status_of(lambda call=call: call(client, saved.key))
            assert err.code == grpc.StatusCode.PERMISSION_DENIED, (name, err)
            assert f"{name} is an operator call" in str(err)
        client.delete(saved.key)  # a runtime deletes the states llama.cpp rejects
    with d.client(auth=ClientAuth()) as local:  # the unix socket is the operator's
        assert local.list_entries() == []


# -- TLS and mutual TLS -------------------------------------------------------------------


def test_mutual_tls_admits_only_certified_clients(daemon_factory: DaemonFactory,
                                                  pki: dict[str, Path]) -> None:
    d = daemon_factory("--listen", "127.0.0.1:0", "--tls-cert", str(pki["server_cert"]),
                       "--tls-key", str(pki["server_key"]), "--tls-client-ca", str(pki["ca"]))
    address = tcp_address(d)
    assert "mutual TLS" in d.log()

    certified = ClientAuth.load(tls_ca=pki["ca"], tls_cert=pki["client_cert"],
                                tls_key=pki["client_key"])
    with CacheClient(address, auth=certified, timeout=5) as client:
        round_trip(client, 50)

    refused = {
        "no certificate": ClientAuth.load(tls_ca=pki["ca"]),
        "another CA's certificate": ClientAuth.load(tls_ca=pki["ca"], tls_cert=pki["rogue_cert"],
                                                    tls_key=pki["rogue_key"]),
        "plaintext": ClientAuth(),
    }
    for what, auth in refused.items():
        with CacheClient(address, auth=auth, timeout=3) as client:
            err = status_of(client.stats)
            assert isinstance(err, CacheUnavailable), f"{what}: {err!r}"
            assert err.code == grpc.StatusCode.UNAVAILABLE, f"{what}: {err.code}"

    # The CLI presents the same certificate, and fails clearly without it.
    ok = kvcache_cli("stats", "-a", address, "--tls-ca", str(pki["ca"]), "--tls-cert",
                     str(pki["client_cert"]), "--tls-key", str(pki["client_key"]), "--json")
    assert ok.returncode == 0, ok.stderr
    bad = kvcache_cli("stats", "-a", address, "--tls-ca", str(pki["ca"]), "--json")
    assert bad.returncode == 1 and "TLS handshake" in bad.stderr, bad.stderr


def test_tls_with_a_token(daemon_factory: DaemonFactory, pki: dict[str, Path],
                          tmp_path: Path) -> None:
    token_file = write_token(tmp_path / "token")
    d = daemon_factory("--listen", "127.0.0.1:0", "--tls-cert", str(pki["server_cert"]),
                       "--tls-key", str(pki["server_key"]), "--token-file", str(token_file))
    address = tcp_address(d)
    assert "clear text" not in d.log()
    with CacheClient(address, auth=ClientAuth.load(tls_ca=pki["ca"])) as no_token:
        assert status_of(no_token.stats).code == grpc.StatusCode.UNAUTHENTICATED
    with CacheClient(address, auth=ClientAuth.load(token_file=token_file,
                                                   tls_ca=pki["ca"])) as client:
        round_trip(client, 30)
    # Without the CA the client cannot trust the daemon's certificate.
    with CacheClient(address, auth=ClientAuth.load(token_file=token_file),
                     timeout=3) as untrusting:
        assert isinstance(status_of(untrusting.stats), CacheUnavailable)


# -- the model runtime: its own TCP port, and its connection to a protected daemon ------


def test_runtime_tcp_port_and_cache_connection_use_tokens(
        daemon_factory: DaemonFactory, tiny_model: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from model_runtime.client import RuntimeClient
    from tests.support.runtime_proc import RuntimeProcess

    cache_token = write_token(tmp_path / "cache-token")
    runtime_token = write_token(tmp_path / "runtime-token", "r" * 32)
    d = daemon_factory("--listen", "127.0.0.1:0", "--token-file", str(cache_token))
    # The runtime reaches the daemon over TCP with the token named by the environment.
    monkeypatch.setenv("KVCACHE_TOKEN_FILE", str(cache_token))
    rt = RuntimeProcess(tiny_model, tcp_address(d), tmp_path / "runtime.log", "--listen",
                        "127.0.0.1:0", "--token-file", str(runtime_token)).start()
    try:
        address = tcp_address(rt)
        with RuntimeClient(address, timeout=60) as anonymous:
            err = pytest.raises(grpc.RpcError, anonymous.complete, prompt="Hello there",
                                max_tokens=2).value
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
        auth = ClientAuth.load(token_file=runtime_token)
        with RuntimeClient(address, timeout=120, auth=auth) as client:
            prompt = "A prompt long enough to be worth saving in the cache. " * 6
            assert client.complete(prompt=prompt, max_tokens=2)["cache_hit_kind"] == "cold"
            wait_for(lambda: bool(d.client(auth=ClientAuth()).list_entries()),
                     "the runtime's save to reach the daemon over TCP")
            counters = client.stats()["counters"]
            assert int(counters.get("cache_errors", 0)) == 0, counters
            assert int(counters.get("cache_unavailable", 0)) == 0, counters
        with d.client(auth=ClientAuth()) as local:
            seen = local.stats().counters
            assert seen["lookups"] >= 1 and seen["saves_committed"] >= 1, seen
    finally:
        rt.close()

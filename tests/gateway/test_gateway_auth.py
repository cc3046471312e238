"""Who may call the gateway: API keys (bearer, from an owner-only file) and TLS beyond
loopback, refused otherwise; each key's tenant, from the file, never from the caller."""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
import trustme

from tests.support.gateway_proc import (
    ALICE,
    BOB,
    OPERATOR,
    SYSTEM,
    GatewayProcess,
    Gateways,
    chat,
    kill_leftovers,
)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("gwpki")
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    files = {"ca": d / "ca.pem", "ca_key": d / "ca.key", "cert": d / "server.pem",
             "key": d / "server.key",
             "keys": d / "api-keys", "loose": d / "loose-keys", "short": d / "short-keys"}
    ca.cert_pem.write_to_path(str(files["ca"]))
    ca.private_key_pem.write_to_path(str(files["ca_key"]))
    files["cert"].write_bytes(b"".join(b.bytes() for b in server.cert_chain_pems))
    server.private_key_pem.write_to_path(str(files["key"]))
    files["keys"].write_text(f"# key tenant\n{ALICE} alice\n{BOB} bob  # the other one\n"
                             f"{OPERATOR} alice role=admin\n")
    files["loose"].write_text(f"{ALICE} alice\n")
    files["short"].write_text("tooshort alice\n")
    for name in ("keys", "loose", "short"):
        files[name].chmod(0o600)
    files["loose"].chmod(0o644)
    return files


def gateway_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "model_runtime.cli", "gateway", *args],
                          capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.parametrize("args, message", [
    ([], "without API keys (--api-keys FILE) or client certificates (--tls-client-ca) and "
         "TLS"),
    (["--api-keys", "{keys}"], "without TLS"),
    (["--tls-cert", "{cert}", "--tls-key", "{key}"], "without API keys"),  # TLS admits all
    (["--api-keys", "{keys}", "--tls-client-ca", "{ca}"], "needs --tls-cert"),
    (["--api-keys", "{loose}", "--tls-cert", "{cert}", "--tls-key", "{key}"], "chmod 600"),
    (["--api-keys", "{short}", "--tls-cert", "{cert}", "--tls-key", "{key}"], "at least 16"),
    (["--api-keys", "{keys}", "--tls-cert", "{cert}"], "go together"),
])
def test_listener_beyond_loopback_is_refused_without_keys_and_tls(
        pki: dict[str, Path], tiny_model: Path, args: list[str], message: str) -> None:
    given = [a.format(**{k: str(v) for k, v in pki.items()}) for a in args]
    result = gateway_cli("--listen", "0.0.0.0:0", "--model", str(tiny_model), "--cache",
                         "none", *given)
    assert result.returncode == 1, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr


@pytest.fixture(scope="module")
def tls_gw(gateways: Gateways, pki: dict[str, Path], tiny_model: Path) -> GatewayProcess:
    """Beyond loopback, with keys and TLS: one worker for both tenants, one daemon."""
    gateway = gateways.start(
        "tls_gw", args=("--model", f"tiny={tiny_model}", "--n-ctx", "1024", "--n-seq-max", "2",
                        "--listen", "0.0.0.0:0", "--api-keys", str(pki["keys"]),
                        "--tls-cert", str(pki["cert"]), "--tls-key", str(pki["key"])),
        workers_ready=False, clean_stop=False)
    gateway.url = gateway.url.replace("0.0.0.0", "127.0.0.1")
    assert gateway.url.startswith("https://")
    context = ssl.create_default_context(cafile=str(pki["ca"]))
    status = wait_status(gateway, context)
    gateways.worker_pids(gateway, [w["pid"] for w in status["workers"]])
    return gateway


def wait_status(gateway: GatewayProcess, context: ssl.SSLContext) -> dict[str, object]:
    import time

    deadline = time.monotonic() + 60
    while True:
        code, body = get(gateway, "/status", context, OPERATOR)
        status = json.loads(body)
        if code == 200 and all(w["state"] == "ready" for w in status["workers"]):
            return status
        assert time.monotonic() < deadline, gateway.log()
        time.sleep(0.05)


def get(gateway: GatewayProcess, path: str, context: ssl.SSLContext,
        key: str | None = None) -> tuple[int, bytes]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    req = urllib.request.Request(f"{gateway.url}{path}", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30, context=context) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def client(gateway: GatewayProcess, pki: dict[str, Path], key: str) -> openai.OpenAI:
    context = ssl.create_default_context(cafile=str(pki["ca"]))
    return gateway.client(api_key=key, http_client=openai.DefaultHttpxClient(verify=context))


def test_requests_need_a_known_key(tls_gw: GatewayProcess, pki: dict[str, Path]) -> None:
    for key in ("x" * 32, ALICE[:-1] + "X", ALICE + "X"):
        with pytest.raises(openai.AuthenticationError) as err:
            client(tls_gw, pki, key).models.list()
        assert err.value.status_code == 401 and err.value.code == "invalid_api_key"
    assert [m.id for m in client(tls_gw, pki, BOB).models.list()] == ["tiny"]


def test_health_is_open_the_rest_is_not(tls_gw: GatewayProcess, pki: dict[str, Path]) -> None:
    context = ssl.create_default_context(cafile=str(pki["ca"]))
    assert get(tls_gw, "/health", context)[0] == 200
    for path in ("/status", "/metrics", "/v1/models"):
        code, body = get(tls_gw, path, context)
        assert code == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
        assert get(tls_gw, path, context, OPERATOR)[0] == 200
        # A tenant's key: its own numbers of /metrics; /status is the operator's.
        assert get(tls_gw, path, context, ALICE)[0] == (403 if path == "/status" else 200)
    untrusting = ssl.create_default_context()  # TLS is real: an unknown CA is refused
    with pytest.raises(urllib.error.URLError):
        get(tls_gw, "/health", untrusting)


def test_each_key_runs_as_its_tenant(tls_gw: GatewayProcess, pki: dict[str, Path]) -> None:
    messages = chat("Tenant test. " + SYSTEM, "What is in aisle 3?")
    alice, bob = client(tls_gw, pki, ALICE), client(tls_gw, pki, BOB)
    first = alice.chat.completions.create(model="tiny", messages=messages, max_tokens=3,
                                          temperature=0)
    # The caller cannot pick its tenant: a "tenant" field is refused like any unknown one.
    with pytest.raises(openai.BadRequestError) as err:
        bob.chat.completions.create(model="tiny", messages=messages, max_tokens=3,
                                    temperature=0, extra_body={"tenant": "alice"})
    assert err.value.body["param"] == "tenant"  # type: ignore[index]
    other = bob.chat.completions.create(model="tiny", messages=messages, max_tokens=3,
                                        temperature=0)
    again = alice.chat.completions.create(model="tiny", messages=messages, max_tokens=3,
                                          temperature=0)
    assert first.model_extra["kvcache"]["tenant"] == "alice"
    assert other.model_extra["kvcache"]["tenant"] == "bob"
    # One worker serves both (tests/gateway/test_gateway_tenants.py has the details) ...
    assert first.model_extra["kvcache"]["worker"] == other.model_extra["kvcache"]["worker"]
    # ... and Bob's identical prompt finds nothing of Alice's (another salt) ...
    assert other.usage.prompt_tokens_details.cached_tokens < 10
    # ... while Alice's own second request is warm.
    assert again.usage.prompt_tokens_details.cached_tokens > 200
    assert other.choices[0].message.content == first.choices[0].message.content


def test_loopback_without_keys_needs_none(tmp_path: Path, tiny_model: Path) -> None:
    gateway = GatewayProcess(tmp_path / "gateway.log", "--model", f"tiny={tiny_model}",
                             "--n-ctx", "512", "--n-seq-max", "1")
    pids: list[int] = []
    try:
        gateway.start()
        pids = [w["pid"] for w in gateway.status()["workers"]]
        done = gateway.client().completions.create(model="tiny", prompt="Whiskey",
                                                   max_tokens=2)
        assert done.model_extra["kvcache"]["tenant"] == ""
    finally:
        gateway.close()
        kill_leftovers(pids)
    assert not os.path.exists(gateway.dir)


def test_client_certificates_authenticate_beyond_loopback(
        tmp_path: Path, pki: dict[str, Path], tiny_model: Path) -> None:
    """Mutual TLS, no keys: a caller without a certificate the CA signed is refused in the
    handshake; one with it is served (as the default tenant)."""
    ca = trustme.CA.from_pem(pki["ca"].read_bytes(), pki["ca_key"].read_bytes())
    issued = ca.issue_cert("client.example")
    client_pem = tmp_path / "client.pem"
    client_pem.write_bytes(b"".join(b.bytes() for b in issued.cert_chain_pems) +
                           issued.private_key_pem.bytes())
    gateway = GatewayProcess(tmp_path / "gateway.log", "--model", f"tiny={tiny_model}",
                             "--n-ctx", "512", "--n-seq-max", "1", "--listen", "0.0.0.0:0",
                             "--tls-cert", str(pki["cert"]), "--tls-key", str(pki["key"]),
                             "--tls-client-ca", str(pki["ca"]))
    pids: list[int] = []
    try:
        gateway.start(workers_ready=False)
        gateway.url = gateway.url.replace("0.0.0.0", "127.0.0.1")
        without = ssl.create_default_context(cafile=str(pki["ca"]))
        with pytest.raises((urllib.error.URLError, ConnectionError, ssl.SSLError)):
            get(gateway, "/health", without)
        with_cert = ssl.create_default_context(cafile=str(pki["ca"]))
        with_cert.load_cert_chain(str(client_pem))
        status = wait_status(gateway, with_cert)
        pids = [w["pid"] for w in status["workers"]]
        client = gateway.client(http_client=openai.DefaultHttpxClient(verify=with_cert))
        done = client.completions.create(model="tiny", prompt="Yankee", max_tokens=2)
        assert done.model_extra["kvcache"]["tenant"] == ""
    finally:
        gateway.close()
        kill_leftovers(pids)

"""Connections a client leaves half-sent or holds open cannot lock others out: a real
gateway process whose requests must arrive in time (headers within 2 s, a body within 2 s
of its headers) and whose connections are capped (12 open, 4 from one address). Over its
address's cap a connection is answered 503 at once while other addresses are served; at
the total cap the connection idle longest makes room (a 503 only when every one has a
request in progress). The default caps come from the file limit the process finds
(``prlimit``).

Client addresses: every 127.x.y.z is this host's loopback, so each test's connections
come from an address of their own (the others' may still be open).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.support.gateway_proc import (
    ALICE,
    OPERATOR,
    GatewayProcess,
    Gateways,
    kill_leftovers,
    metrics,
    wait_gone,
)

HEADER_TIMEOUT = 2.0
BODY_TIMEOUT = 2.0
TOTAL = 12
PER_CLIENT = 4


@pytest.fixture(scope="module")
def gw(gateways: Gateways, tiny_model_no_eog: Path) -> GatewayProcess:
    return gateways.start(
        "gateway_connections", keys=f"{ALICE} alice\n{OPERATOR} alice role=admin\n",
        args=("--model", f"tiny={tiny_model_no_eog}", "--n-ctx", "4096", "--n-seq-max", "2",
              "--header-timeout", str(HEADER_TIMEOUT), "--body-timeout", str(BODY_TIMEOUT),
              "--max-connections", str(TOTAL), "--max-connections-per-client",
              str(PER_CLIENT)),
        cache="none", admin_key=OPERATOR, clean_stop=False)


def connect(gw: GatewayProcess, source: str, timeout: float = 10.0) -> socket.socket:
    """A TCP connection to the gateway from ``source`` (a loopback address)."""
    url = urlsplit(gw.url)
    return socket.create_connection((url.hostname, url.port), timeout=timeout,
                                    source_address=(source, 0))


def read_until_closed(conn: socket.socket) -> bytes:
    answer = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := conn.recv(65536):
            answer += chunk
    return answer


def small_request(gw: GatewayProcess, source: str = "127.0.0.1") -> int:
    """A one-token completion from ``source``: its status."""
    url = urlsplit(gw.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30,
                                      source_address=(source, 0))
    try:
        conn.request("POST", "/v1/completions", json.dumps(
            {"model": "tiny", "prompt": "Alpha", "max_tokens": 1}),
            {"Authorization": f"Bearer {ALICE}", "Content-Type": "application/json"})
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def test_a_request_whose_headers_do_not_come_is_closed(gw: GatewayProcess) -> None:
    """Half a request line, then nothing: closed once the header timeout passes (it used
    to stay open for an hour, aiohttp's keep-alive default)."""
    with connect(gw, "127.0.1.1") as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
        started = time.monotonic()
        assert read_until_closed(conn) == b""
        waited = time.monotonic() - started
    assert HEADER_TIMEOUT - 0.5 < waited < HEADER_TIMEOUT + 3, waited


def test_an_idle_connection_is_closed_after_the_header_timeout(gw: GatewayProcess) -> None:
    with connect(gw, "127.0.1.2") as conn:
        started = time.monotonic()
        assert read_until_closed(conn) == b""
        assert time.monotonic() - started < HEADER_TIMEOUT + 3


def test_a_body_that_does_not_come_is_a_408(gw: GatewayProcess) -> None:
    """Headers promise 1,000 bytes, 10 come: a 408 once the body timeout passes, and
    the connection closed."""
    with connect(gw, "127.0.1.3") as conn:
        conn.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                     f"{ALICE}\r\nContent-Type: application/json\r\nContent-Length: 1000"
                     f"\r\n\r\n{{\"model\": ".encode())
        started = time.monotonic()
        answer = read_until_closed(conn)
        waited = time.monotonic() - started
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), answer[:300]
    assert json.loads(body)["error"]["code"] == "request_timeout"
    assert BODY_TIMEOUT - 0.5 < waited < BODY_TIMEOUT + 3, waited


def test_a_streamed_answer_outlasts_the_timeouts(gw: GatewayProcess) -> None:
    """The timeouts bound how long a request takes to arrive, never its answer: a stream
    read slowly for three times the timeouts ends with its [DONE]."""
    client = gw.client(api_key=ALICE)
    started = time.monotonic()
    finish = None
    with client.completions.create(model="tiny", prompt="Alpha", max_tokens=40,
                                   stream=True) as events:
        for i, event in enumerate(events):
            # A slow reader: three times the timeouts after the first event, then a
            # quarter of a second an event (tokens that were ready at once share one).
            time.sleep(3 * max(HEADER_TIMEOUT, BODY_TIMEOUT) if i == 0 else 0.25)
            if event.choices and event.choices[0].finish_reason:
                finish = event.choices[0].finish_reason
    assert time.monotonic() - started > 3 * max(HEADER_TIMEOUT, BODY_TIMEOUT)
    assert finish == "length"


def test_over_the_per_address_cap_a_connection_is_a_503_others_are_served(
        gw: GatewayProcess) -> None:
    """Four connections from one address that send nothing: a fifth from it is answered
    503 at once; a client at another address is served meanwhile; once the header
    timeout closed the four, the address is served again."""
    held = [connect(gw, "127.0.2.1") for _ in range(PER_CLIENT)]
    try:
        time.sleep(0.2)  # (accepted and counted)
        with connect(gw, "127.0.2.1") as extra:
            started = time.monotonic()
            answer = read_until_closed(extra)
            assert time.monotonic() - started < 1.5  # at once, not at a timeout
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503"), answer[:300]
        assert json.loads(body)["error"]["code"] == "too_many_connections"
        assert small_request(gw, "127.0.2.2") == 200
    finally:
        for conn in held:
            conn.close()
    time.sleep(0.3)  # (the gateway sees them closed)
    assert small_request(gw, "127.0.2.1") == 200


def test_at_the_total_cap_the_connection_idle_longest_makes_room(gw: GatewayProcess) -> None:
    """Twelve connections from three addresses that send nothing (the total cap): a client
    at a fourth address is served, and the connection idle longest is closed for it."""
    before = closed(gw)
    held = []
    try:
        for i in range(TOTAL):
            held.append(connect(gw, f"127.0.3.{1 + i % 3}"))
            time.sleep(0.02)  # (in order: the first is the oldest)
        time.sleep(0.2)
        assert small_request(gw, "127.0.3.9") == 200
        held[0].settimeout(5)
        assert read_until_closed(held[0]) == b""  # closed, without an answer
        held[1].setblocking(False)
        with pytest.raises(BlockingIOError):  # the next oldest still open
            held[1].recv(1)
    finally:
        for conn in held:
            conn.close()
    assert closed(gw)["idle"] >= before.get("idle", 0) + 1


def test_over_the_total_cap_of_busy_connections_one_more_is_a_503(gw: GatewayProcess
                                                                   ) -> None:
    """Twelve connections each in the middle of a request (their bodies not all sent):
    none is idle, so a thirteenth is answered 503 at once; once their bodies timed out,
    it is served."""
    before = closed(gw)
    held = [connect(gw, f"127.0.5.{1 + i % 3}") for i in range(TOTAL)]
    try:
        for conn in held:
            conn.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: "
                         f"Bearer {ALICE}\r\nContent-Length: 100\r\n\r\n{{".encode())
        time.sleep(0.3)
        with connect(gw, "127.0.5.9") as extra:
            answer = read_until_closed(extra)
        assert answer.startswith(b"HTTP/1.1 503"), answer[:300]
        assert b"this server's limit" in answer
    finally:
        for conn in held:
            conn.close()
    time.sleep(0.3)
    assert small_request(gw, "127.0.5.9") == 200
    assert closed(gw)["total"] == before.get("total", 0) + 1


def closed(gw: GatewayProcess) -> dict[str, float]:
    """Connections refused by cap, and closed while idle ("idle"), so far."""
    counts = {}
    for line in metrics(gw, OPERATOR).splitlines():
        if line.startswith("kvcache_gateway_connections_refused_total{"):
            cap = line.split('cap="', 1)[1].split('"', 1)[0]
            counts[cap] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("kvcache_gateway_connections_idle_closed_total "):
            counts["idle"] = float(line.rsplit(" ", 1)[1])
    return counts


# --------------------------------------------------------------------------- file limit


def gateway_under_file_limit(tmp_path: Path, model: Path, files: int,
                             *args: str) -> GatewayProcess:
    gateway = GatewayProcess(tmp_path / "gateway.log", "--model", f"tiny={model}",
                             "--n-ctx", "512", "--n-seq-max", "1", *args)
    gateway.command = ["prlimit", f"--nofile={files}:{files}", "--", *gateway.command]
    return gateway


def test_the_default_caps_come_from_the_file_limit(tmp_path: Path, tiny_model: Path) -> None:
    """Under ``ulimit -n 1024`` the gateway keeps its connections below the limit (and
    says so): 1,024 less its own files (64, 8 a worker) and those of connections being
    accepted and refused (128, 32); more than the limit allows is refused at start-up,
    naming the option."""
    gateway = gateway_under_file_limit(tmp_path, tiny_model, 1024)
    pids: list[int] = []
    try:
        gateway.start()
        pids = [w["pid"] for w in gateway.status()["workers"]]
        assert "connections: at most 792 open, 198 from one address (open files: 1024)" \
            in gateway.log()
        assert small_request(gateway) != 503  # (no key file: served, whoever it is)
    finally:
        gateway.close()
        wait_gone(pids)
        kill_leftovers(pids)
    for files, option, message in ((1024, ["--max-connections", "5000"],
                                    "--max-connections 5000 is more than the file limit "
                                    "allows: 1024 open files"),
                                   (200, [], "the file limit of 200 open files")):
        done = subprocess.run(["prlimit", f"--nofile={files}:{files}", "--", sys.executable,
                               "-m", "model_runtime.cli", "gateway", "--listen",
                               "127.0.0.1:0", "--cache", "none", "--model", str(tiny_model),
                               *option], capture_output=True, text=True, timeout=60)
        assert done.returncode != 0 and message in done.stderr, done.stderr[-2000:]


def test_metrics_count_open_connections(gw: GatewayProcess) -> None:
    with connect(gw, "127.0.4.1"), connect(gw, "127.0.4.1"):
        time.sleep(0.2)
        text = metrics(gw, OPERATOR)
    (line,) = [x for x in text.splitlines() if x.startswith("kvcache_gateway_connections ")]
    assert float(line.split()[1]) >= 3  # these two and the scrape's own

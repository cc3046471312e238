"""The cache daemon of a gateway started as README says: with no ``--cache``, in a home
where no daemon runs, the gateway starts ``kvcache serve`` on the default data directory
itself, stops it with itself, starts it again if it dies, and two gateways in one home
share one; a ``--cache`` address that does not answer stops the start-up, ``--cache none``
starts nothing.

Real processes throughout: the gateway, its ``model-runtime serve`` worker on the tiny
model, the daemon it starts, each in a fresh ``HOME`` (a short folder in /tmp, so that the
default socket path fits), whose RAM tier in /dev/shm is removed after each test.
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness.procs import REPO, short_workdir

from kvcache.config import ENV_ADDRESS, ENV_DIR
from kvcache.store.ramtier import tier_dir
from tests.support.gateway_proc import GatewayProcess, chat, kill_leftovers, wait_gone
from tests.support.leftovers import command_line, descendants

WORDS = ("the", "store", "opens", "at", "nine", "and", "closes", "when", "every", "aisle",
         "is", "tidy", "ask", "for", "bolts", "nails", "glue", "or", "paint", "kindly")
# A 600-word system prompt (~3,000 tokens of the tiny model's byte-level vocabulary).
SYSTEM_600 = " ".join(WORDS[(i * 7) % len(WORDS)] for i in range(600)) + "."


@pytest.fixture
def home() -> Iterator[Path]:
    """A fresh home: no daemon, no data directory. The daemons started in it are the
    tests' to stop; its RAM tier (which outlives a daemon on purpose) is removed here."""
    path = short_workdir("rtgh")
    try:
        yield path
    finally:
        shutil.rmtree(tier_dir(data_dir(path)), ignore_errors=True)
        shutil.rmtree(path, ignore_errors=True)


def data_dir(home: Path) -> Path:
    return home / ".cache" / "kvcache"


def home_env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in (ENV_DIR, ENV_ADDRESS, "XDG_CACHE_HOME")}
    return {**env, "HOME": str(home), **extra}


def gateway(home: Path, model: Path, *args: str, name: str = "gateway",
            cache: str | None = None) -> GatewayProcess:
    return GatewayProcess(home / f"{name}.log", "--model", f"tiny={model}", "--n-ctx", "8192",
                          "--n-seq-max", "2", *args, cache=cache, env=home_env(home))


def cache_status(gw: GatewayProcess) -> dict[str, Any]:
    status: dict[str, Any] = gw.status()["cache"]
    return status


def ask(gw: GatewayProcess, user: str = "Do you sell nails?") -> Any:
    return gw.client().chat.completions.create(
        model="tiny", max_tokens=4, temperature=0, messages=chat(SYSTEM_600, user))


def cached(response: Any) -> int:
    return int(response.usage.prompt_tokens_details.cached_tokens)


def wait_cache(gw: GatewayProcess, predicate: Any, what: str, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        status = cache_status(gw)
        if predicate(status):
            return status
        if time.monotonic() > deadline:
            raise AssertionError(f"the cache daemon did not reach: {what}: {status}\n"
                                 f"{gw.log()[-3000:]}")
        time.sleep(0.1)


def kvcache_daemons(pid: int) -> list[int]:
    """Descendants of ``pid`` running ``kvcache serve``."""
    return [p for p in descendants(pid) if "kvcache.cli serve" in command_line(p)]


def test_a_gateway_without_a_daemon_starts_one_whose_cache_outlives_the_gateway_s_restart(
        home: Path, tiny_model: Path) -> None:
    gw = gateway(home, tiny_model)
    pids: list[int] = []
    try:
        gw.start()
        daemon = cache_status(gw)
        assert daemon["managed"] and daemon["child"] and daemon["state"] == "ready"
        assert daemon["address"] == f"unix:{data_dir(home) / 'kvcache.sock'}"
        assert kvcache_daemons(gw.pid) == [daemon["pid"]]
        pids = [daemon["pid"]]
        assert stat.S_IMODE(data_dir(home).stat().st_mode) == 0o700
        assert "running without a cache" not in gw.log()

        first = ask(gw)
        assert cached(first) < 10 and first.usage.prompt_tokens > 2000
        assert gw.stop() == 0, gw.log()[-3000:]  # the worker saves, then the daemon stops
        assert wait_gone(pids), "the daemon outlived the gateway"
        assert not (data_dir(home) / "kvcache.sock").exists()

        gw.start()  # a new worker, a new daemon: nothing live survives
        pids = [cache_status(gw)["pid"]]
        again = ask(gw)
        details = again.model_extra["kvcache"]
        assert cached(again) > 2000, details
        assert details["tier"] in ("ram", "disk") and details["hit_kind"] != "cold"
    finally:
        gw.close()
        kill_leftovers(pids)


def test_the_daemon_the_gateway_started_is_started_again_when_it_dies(
        home: Path, tiny_model: Path) -> None:
    gw = gateway(home, tiny_model, "--restart-backoff", "0.1")
    pids: list[int] = []
    try:
        gw.start()
        ask(gw)
        first = cache_status(gw)["pid"]
        pids = [first]
        os.kill(first, signal.SIGKILL)
        status = wait_cache(gw, lambda s: s["state"] == "ready" and s["pid"] not in
                            (None, first), "started again")
        pids.append(status["pid"])
        assert status["restarts"] == 1 and status["child"]
        assert status["restart_history"][0]["text"].startswith("daemon_died")
        again = ask(gw, "And screws?")
        assert cached(again) > 2000  # the daemon's entries survived its death
    finally:
        gw.close()
        kill_leftovers(pids)


def test_a_killed_gateway_leaves_no_daemon_behind(home: Path, tiny_model: Path) -> None:
    gw = gateway(home, tiny_model)
    pids: list[int] = []
    try:
        gw.start()
        pids = [cache_status(gw)["pid"]] + [w["pid"] for w in gw.status()["workers"]]
        os.kill(gw.pid, signal.SIGKILL)
        assert gw.proc is not None and gw.proc.wait(30) == -signal.SIGKILL
        assert wait_gone(pids), "a child outlived the killed gateway"
    finally:
        gw.close()
        kill_leftovers(pids)


def test_two_gateways_started_at_once_in_one_home_share_one_daemon(
        home: Path, tiny_model: Path) -> None:
    """The second one's daemon finds the data directory taken and exits; that gateway
    uses the first one's daemon, and starts its own once that one is gone."""
    fast = ("--health-interval", "0.2", "--restart-backoff", "0.1")
    one = gateway(home, tiny_model, *fast, name="one")
    two = gateway(home, tiny_model, *fast, name="two")
    pids: list[int] = []
    try:
        one.spawn()
        two.spawn()
        deadline = time.monotonic() + 120
        one.wait_ready(deadline)
        two.wait_ready(deadline)
        statuses = {gw: cache_status(gw) for gw in (one, two)}
        assert all(s["state"] == "ready" for s in statuses.values()), statuses
        owners = [gw for gw, s in statuses.items() if s["child"]]
        assert len(owners) == 1, statuses
        owner = owners[0]
        other = two if owner is one else one
        assert statuses[other]["pid"] is None
        pids = [statuses[owner]["pid"]]
        assert kvcache_daemons(owner.pid) == pids and kvcache_daemons(other.pid) == []
        assert cached(ask(other)) < 10
        assert cached(ask(owner, "And glue?")) > 2000  # one cache for both

        assert owner.stop() == 0
        assert wait_gone(pids)
        status = wait_cache(other, lambda s: s["child"] and s["state"] == "ready",
                            "its own daemon, once the other one is gone")
        pids.append(status["pid"])
        assert status["restart_history"][0]["text"].startswith("daemon_gone")
        assert cached(ask(other, "And paint?")) > 2000
    finally:
        for gw in (one, two):
            gw.close()
        kill_leftovers(pids)


def readme_gateway_snippet() -> str:
    """The first Python snippet of README's gateway section."""
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## OpenAI-compatible gateway"):]
    start = section.index("```python\n") + len("```python\n")
    return section[start:section.index("```", start)]


def test_the_readme_s_first_gateway_snippet_runs_as_written(
        home: Path, tiny_model: Path) -> None:
    """Against a gateway started as README says (the tiny model under the default one's
    name), only the URL changed: it used a system prompt it never defined."""
    gw = GatewayProcess(home / "gateway.log", "--model",
                        f"SmolLM2-135M-Instruct.Q4_1={tiny_model}", "--n-ctx", "8192",
                        cache=None, env=home_env(home))
    pids: list[int] = []
    try:
        gw.start()
        pids = [cache_status(gw)["pid"]]
        code = readme_gateway_snippet().replace("http://127.0.0.1:8000", gw.url)
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=120, check=False)
        assert done.returncode == 0, done.stderr
        lines = done.stdout.splitlines()
        assert len(lines) == 2 and int(lines[0].split()[0]) < 10, lines
        assert int(lines[1].split()[0]) > 1000, lines  # the system prompt, from cache
    finally:
        gw.close()
        kill_leftovers(pids)


def gateway_cli(home: Path, model: Path, *args: str,
                **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "model_runtime.cli", "gateway", "--model",
                           f"tiny={model}", "--listen", "127.0.0.1:0", *args],
                          capture_output=True, text=True, timeout=120, check=False,
                          env=home_env(home, **env))


@pytest.mark.parametrize("named_by", ["--cache", ENV_ADDRESS])
def test_a_cache_address_asked_for_that_does_not_answer_stops_the_start_up(
        home: Path, tiny_model: Path, named_by: str) -> None:
    address = f"unix:{home / 'nobody.sock'}"
    if named_by == "--cache":
        done = gateway_cli(home, tiny_model, "--cache", address)
    else:
        done = gateway_cli(home, tiny_model, **{ENV_ADDRESS: address})
    assert done.returncode == 1, done.stderr
    assert f"no cache daemon answers at {address} ({named_by})" in done.stderr
    assert "--cache none" in done.stderr
    assert "gateway listening" not in done.stderr  # no worker, no daemon started
    assert not data_dir(home).exists()


def test_a_daemon_that_cannot_start_stops_the_start_up_saying_why(
        home: Path, tiny_model: Path) -> None:
    data_dir(home).mkdir(parents=True)
    (data_dir(home) / "notes.txt").write_text("not a cache\n")  # a folder kvcache refuses
    done = gateway_cli(home, tiny_model)
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"cannot start a cache daemon at unix:{data_dir(home)}")
    assert "is not a kvcache data directory" in last and "--cache none" in last
    assert "gateway listening" not in done.stderr
    assert sorted(os.listdir(data_dir(home))) == ["notes.txt"]  # nothing touched


def test_cache_none_starts_no_daemon(home: Path, tiny_model: Path) -> None:
    gw = gateway(home, tiny_model, cache="none")
    pids: list[int] = []
    try:
        gw.start()
        pids = [w["pid"] for w in gw.status()["workers"]]
        assert cache_status(gw) == {"address": None, "managed": False}
        assert kvcache_daemons(gw.pid) == []
        reply = ask(gw)
        assert reply.model_extra["kvcache"]["tokens_saved"] == 0
        assert not (data_dir(home) / "daemon.lock").exists()
    finally:
        gw.close()
        kill_leftovers(pids)

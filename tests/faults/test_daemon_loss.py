"""Daemon loss under traffic: a real runtime (the tiny model, real llama.cpp) serves a
stream of requests from several threads while its cache daemon is stopped (SIGTERM),
started again, killed (SIGKILL) and started again on the same data directory.

test_runtime.py already covers one request decoding through a kill and a single cold
request while the daemon is down. Here: concurrent requests through both kinds of loss,
every completion compared with a cold greedy run, a latency bound derived from the
runtime's cache deadlines, and caching resuming by itself each time the daemon returns.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from kvcache.client import CacheClient
from model_runtime.config import RuntimeConfig
from model_runtime.request import Completion
from model_runtime.runtime import Runtime
from tests.support.daemon_proc import DaemonProcess
from tests.support.tiny_llama import sample_prompt

CONFIG = RuntimeConfig(n_ctx=1024, n_batch=256, n_seq_max=2, n_threads=1, prefill_chunk=128,
                       save_block=32, trim=8, min_save_tokens=8, continued_interval=0,
                       cache_timeout_s=1.0, shutdown_deadline_s=10.0,
                       reuse_live=False)  # these tests follow the daemon path
T = CONFIG.cache_timeout_s
# The most cache I/O one request can wait for (Resolver.find_state): the block size (a
# Stats call, once), then up to two rounds of lookup (T) + load (4 T).
RESOLVE_WORST_S = T + 2 * (T + 4 * T)
WORKERS = 3  # on CONFIG.n_seq_max = 2 sequences: requests also queue for a sequence
PHASE_S = 2.0  # how long each state (up, stopped, up, killed, up) lasts under traffic
TEXTS = [
    "the cat and the dog sat on the mat with a hat, ",
    "in the end it is what it is, or so they say to you. ",
    "Numbers: 3.14159, 2718, 42! Letters: abc def ghi. ",
    "over the hills and far away the river runs to the sea; ",
    "a stitch in time saves nine, and nine saves ten more. ",
    "one two three four five six seven eight nine ten eleven. ",
]
MAX_TOKENS = 8


@dataclass(frozen=True)
class Done:
    worker: int
    prompt: int
    started: float
    ended: float
    completion: Completion | None
    error: str = ""

    @property
    def seconds(self) -> float:
        return self.ended - self.started


@pytest.fixture
def runtimes(tiny_model: Path, daemon_factory: Callable[..., DaemonProcess]
             ) -> Iterator[tuple[Runtime, Runtime, DaemonProcess]]:
    """(runtime on a daemon, runtime without a cache for reference outputs, the daemon)."""
    daemon = daemon_factory()
    with Runtime(tiny_model, cache_address=None, config=replace(CONFIG, n_seq_max=1)) as plain, \
            Runtime(tiny_model, cache_address=daemon.address, config=CONFIG) as rt:
        yield rt, plain, daemon


def settled(rt: Runtime) -> None:
    assert rt.engine.saver.flush(30), "saves did not reach the daemon"


@pytest.mark.slow
def test_requests_complete_through_sigterm_sigkill_and_restarts(
        runtimes: tuple[Runtime, Runtime, DaemonProcess]) -> None:
    rt, plain, daemon = runtimes
    prompts = [sample_prompt(rt.tokenize, 90 + 7 * i, text) for i, text in enumerate(TEXTS)]
    # Cold greedy references, and how long the slowest takes on its own.
    reference: list[list[int]] = []
    slowest = 0.0
    for p in prompts:
        t0 = time.monotonic()
        reference.append(plain.complete(tokens=p, max_tokens=MAX_TOKENS).tokens)
        slowest = max(slowest, time.monotonic() - t0)
    # A request may wait for the other sequences' requests, then for its cache I/O (cut
    # off at the client deadlines), then compute. Generous factors: the bound only has to
    # catch a request hanging on a dead daemon, on a machine shared with other work.
    bound = RESOLVE_WORST_S + WORKERS * 10 * max(slowest, 0.1) + 5.0

    # Everything saved while the daemon is up: from here on a prompt is a hit when it can be.
    for p, ref in zip(prompts, reference, strict=True):
        assert rt.complete(tokens=p, max_tokens=MAX_TOKENS).tokens == ref
        settled(rt)  # one at a time: a burst overflows the save queue (dropped, counted)
    warm = {rt.complete(tokens=p, max_tokens=MAX_TOKENS).cache_hit_kind for p in prompts}
    assert warm == {"exact"}, warm  # restored from each prompt's finish state
    before = rt.stats()

    stop = threading.Event()
    done: list[Done] = []
    lock = threading.Lock()

    def worker(w: int) -> None:
        k = w
        while not stop.is_set():
            i = k % len(prompts)
            k += 1
            t0 = time.monotonic()
            try:
                c = rt.complete(tokens=prompts[i], max_tokens=MAX_TOKENS, timeout=bound + 30)
                record = Done(w, i, t0, time.monotonic(), c)  # type: ignore[arg-type]
            except Exception as exc:  # asserted below: a request must never fail
                record = Done(w, i, t0, time.monotonic(), None, repr(exc))
            with lock:
                done.append(record)

    def first_hit_after(t: float) -> float:
        """When the first request started after ``t`` completed warm (polling)."""
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with lock:
                hits = [d.ended for d in done if d.started >= t and d.completion is not None
                        and d.completion.cache_hit_kind != "cold"]
            if hits:
                return min(hits)
            time.sleep(0.05)
        pytest.fail("no request hit the cache within 20 s of the daemon's return")

    # (confirmed gone at, start called at): windows in which the daemon did not exist.
    gone: list[tuple[float, float]] = []
    resumed: list[float] = []  # seconds from the restart to the first hit
    threads = [threading.Thread(target=worker, args=(w,), name=f"req-{w}")
               for w in range(WORKERS)]
    for t in threads:
        t.start()
    time.sleep(PHASE_S)
    for loss in ("SIGTERM", "SIGKILL"):
        if loss == "SIGTERM":
            assert daemon.stop() == 0, "the daemon did not exit cleanly on SIGTERM"
        else:
            daemon.kill()
        down_at = time.monotonic()
        time.sleep(PHASE_S)
        restart_at = time.monotonic()
        gone.append((down_at, restart_at))
        daemon.start()  # same data directory, same socket path; returns once it answers
        # Caching resumes by itself, under traffic: the runtime's client reconnects (its
        # backoff is at most 2 s) and requests are restored again.
        resumed.append(first_hit_after(restart_at) - restart_at)
        time.sleep(PHASE_S / 2)
    stop.set()
    for t in threads:
        t.join(timeout=bound + 60)
    assert not any(t.is_alive() for t in threads), "a request thread hung"

    failed = [d for d in done if d.completion is None]
    assert failed == [], f"requests failed: {failed[:3]}"
    wrong = [d for d in done if d.completion and d.completion.tokens != reference[d.prompt]]
    assert wrong == [], f"{len(wrong)} completions differ from the cold greedy output"
    slow = sorted(d.seconds for d in done if d.seconds > bound)
    assert slow == [], f"requests took longer than the {bound:.1f} s bound: {slow[:5]}"
    inside = [d for d in done if any(a <= d.started and d.ended <= b for a, b in gone)]
    assert len(inside) >= 2 * WORKERS, "too few requests ran while the daemon was gone"
    kinds_inside = Counter(d.completion.cache_hit_kind for d in inside)  # type: ignore[union-attr]
    assert set(kinds_inside) == {"cold"}, kinds_inside
    after = rt.stats()
    for name in ("cache_unavailable", "saves_dropped_unavailable"):
        assert after.get(name, 0) > before.get(name, 0), f"{name} did not move: {after}"

    # The same runtime, never restarted, restores every prompt again: entries committed
    # before the kill survived it.
    for p, ref in zip(prompts, reference, strict=True):
        back = rt.complete(tokens=p, max_tokens=MAX_TOKENS)
        assert back.cache_hit_kind == "exact" and back.tokens == ref
    settled(rt)
    with CacheClient(daemon.address, timeout=10) as c:
        stats = c.stats()
        assert stats.in_flight == 0
        assert all(r.ok for r in c.verify())
    assert not list((daemon.data_dir / "tmp").iterdir())

    by_kind = Counter(d.completion.cache_hit_kind for d in done)  # type: ignore[union-attr]
    print(f"\n[daemon loss] {len(done)} requests from {WORKERS} threads through SIGTERM, "
          f"restart, SIGKILL, restart: {dict(by_kind)}; {len(inside)} while the daemon was "
          f"gone, all cold; hits again {', '.join(f'{r:.1f}' for r in resumed)} s after each "
          f"restart; slowest {max(d.seconds for d in done):.2f} s (bound {bound:.1f} s);"
          f" cache_unavailable +{after['cache_unavailable'] - before.get('cache_unavailable', 0)}"
          f", saves_dropped_unavailable +"
          f"{after['saves_dropped_unavailable'] - before.get('saves_dropped_unavailable', 0)}")

"""Every worker of every model, and admission: a slot on the right worker now, or a clear
refusal.

Tenants share workers: each model has one pool (``workers`` processes) serving every
tenant of the API key file. A request carries its key's tenant to the runtime (the
``tenant`` field of each Complete call), never one the caller names; the runtime salts
that request's lookups, saves and keys with it and reuses a live sequence only for the
tenant whose request filled it, so a shared worker isolates tenants as separate ones did.
Routing keeps them apart too: prefix tracking and sticky/affinity keys are per tenant.
With no key file, every request has the default tenant.

Fairness: on a shared pool one tenant could hold every slot. A tenant may hold at most
:meth:`Fleet.tenant_bound` slots of a model's pool at once (``--max-slots-per-tenant``;
by default half the pool's slots, rounded up, once the key file names two tenants or
more, and no bound for a single tenant); beyond it that tenant gets a 429 while the
others still find slots.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from kvcache.config import default_dir

from .errors import ApiError
from .keys import ApiKeys
from .metrics import GatewayMetrics
from .settings import GatewaySettings
from .workers.cache_daemon import CacheDaemon
from .workers.router import NoFreeSlot, NoReadyWorker, SessionMap, choose, tenant_text
from .workers.slots import Flight, SlotLedger
from .workers.supervisor import FAILED
from .workers.worker import Worker

log = logging.getLogger("model_runtime.gateway")
RETRY_AFTER_S = 1  # what a refused client is told to wait: a slot frees per completion
RUN_DIR_PREFIX = "kvgw-"
PID_FILE = "gateway.pid"


def sweep_stale_run_dirs(parent: Path = Path("/tmp")) -> list[Path]:
    """Remove the socket folders of gateways that were killed (SIGKILL runs no clean-up):
    only folders of this user holding our pid file, whose process is gone."""
    removed = []
    for folder in parent.glob(f"{RUN_DIR_PREFIX}*"):
        try:
            if folder.stat().st_uid != os.getuid():
                continue
            pid = int((folder / PID_FILE).read_text())
        except (OSError, ValueError):
            continue  # not one of ours, or not yet written
        try:
            os.kill(pid, 0)
            continue  # still running
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # alive, someone else's
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


class Fleet:
    def __init__(self, settings: GatewaySettings, keys: ApiKeys | None) -> None:
        self.settings = settings
        self.keys = keys
        self.tenants = keys.tenants if keys is not None else [settings.default_tenant]
        self.started = time.monotonic()
        self.stopping = False
        self._own_run_dir = settings.run_dir is None
        if settings.run_dir is None:
            for stale in sweep_stale_run_dirs():
                log.info("removed %s, left by a gateway that was killed", stale)
            # Short (unix socket paths are limited to 107 bytes) and owner-only.
            self.run_dir = Path(tempfile.mkdtemp(prefix=RUN_DIR_PREFIX, dir="/tmp"))
            (self.run_dir / PID_FILE).write_text(f"{os.getpid()}\n")
        else:
            self.run_dir = settings.run_dir
            self.run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.metrics = GatewayMetrics(self.slot_rows)
        self.ledger = SlotLedger()  # every worker's slots: who holds them
        self.workers: list[Worker] = []
        self.pools: dict[str, list[Worker]] = {}  # by model: every tenant's
        for spec in settings.models:
            pool = self.pools.setdefault(spec.name, [])
            for _ in range(spec.workers):
                name = f"w{len(self.workers)}"
                worker = Worker(name, spec, self.run_dir / f"{name}.sock",
                                settings.cache_address, settings.supervision, self.ledger,
                                on_restart=self.metrics.on_restart,
                                kv_events=settings.worker_kv_events(len(self.workers)))
                pool.append(worker)
                self.workers.append(worker)
        self.sessions = SessionMap()
        self.cache_daemon = CacheDaemon(settings.cache_address, default_dir(),
                                        settings.supervision) \
            if settings.keep_cache_daemon and settings.cache_address else None

    # -- lifetime ---------------------------------------------------------------------------

    async def start_cache(self) -> str | None:
        """Before the workers: the daemon the gateway keeps, serving (its own child or
        another process's). None once it serves; else why none could be started."""
        if self.cache_daemon is None:
            return None
        self.cache_daemon.start()
        return await self.cache_daemon.started()

    def start(self) -> None:
        for worker in self.workers:
            worker.process.start()

    async def stop(self) -> None:
        self.stopping = True
        await asyncio.gather(*(w.process.stop() for w in self.workers))
        # After the workers: they save their live sequences to it as they stop.
        if self.cache_daemon is not None:
            await self.cache_daemon.stop()
        if self._own_run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        else:  # only what the workers made there (a killed runtime leaves its socket)
            for worker in self.workers:
                with contextlib.suppress(OSError):
                    worker.process.socket_path.unlink()

    # -- what clients see -------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return any(w.ready for w in self.workers)

    def model_names(self) -> list[str]:
        return [spec.name for spec in self.settings.models]

    def models(self) -> list[dict[str, Any]]:
        out = []
        for spec in self.settings.models:
            n_ctx = max((w.process.info.n_ctx for w in self.workers
                         if w.spec.name == spec.name), default=0)
            out.append({"id": spec.name, "object": "model", "created": 0,
                        "owned_by": "kvcache", "context_length": n_ctx or None,
                        "max_model_len": n_ctx or None, "workers": spec.workers,
                        "path": str(spec.path)})
        return out

    def status(self) -> dict[str, Any]:
        return {"gateway": {"pid": os.getpid(), "uptime_s": round(time.monotonic() -
                                                                  self.started, 3),
                            "ready": self.ready, "tenants": len(self.tenants)},
                "models": [{**model, "max_slots_per_tenant":
                            self.tenant_bound(self.pools[model["id"]])}
                           for model in self.models()],
                "cache": self.cache_status(),
                "workers": [self.worker_status(w) for w in self.workers]}

    def worker_status(self, worker: Worker) -> dict[str, Any]:
        """A worker's process (state, pid, restarts, logs) and its slots."""
        return {
            **worker.process.status(), "model": worker.spec.name,
            "socket": str(worker.process.socket_path), "slots_total": worker.slots,
            "slots_busy": self.ledger.busy(worker.name),
            "slots_busy_by_tenant": self.ledger.busy_by_tenant(worker.name),
            "served": worker.served, "n_ctx": worker.process.info.n_ctx,
        }

    def slot_rows(self) -> list[tuple[str, str, int, dict[str, int]]]:
        """Each worker's model, state, slots (0 unless ready) and busy slots by tenant,
        for the metrics."""
        return [(w.spec.name, w.process.state, w.slots if w.ready else 0,
                 self.ledger.busy_by_tenant(w.name)) for w in self.workers]

    def cache_status(self) -> dict[str, Any]:
        """The workers' cache daemon: the one the gateway keeps (its state, and whether
        it is the gateway's child), or an address it was given (managed: false)."""
        if self.cache_daemon is not None:
            return self.cache_daemon.status()
        return {"address": self.settings.cache_address, "managed": False}

    # -- admission --------------------------------------------------------------------------

    def tenant_bound(self, pool: list[Worker]) -> int | None:
        """The most slots of ``pool`` one tenant may hold at once (None: no bound):
        ``--max-slots-per-tenant`` if set, else half the pool's slots rounded up when
        there are two tenants or more (one tenant has no one to leave room for)."""
        if self.settings.max_slots_per_tenant is not None:
            return self.settings.max_slots_per_tenant
        total = sum(w.slots for w in pool if w.ready)
        if len(self.tenants) < 2 or total == 0:
            return None
        return math.ceil(total / 2)

    def tenant_busy(self, pool: list[Worker], tenant: str) -> int:
        """Slots of ``pool`` that ``tenant``'s requests hold now."""
        return self.ledger.tenant_busy((w.name for w in pool), tenant)

    def _tenant_full(self, pool: list[Worker], tenant: str, slots: int = 1) -> bool:
        bound = self.tenant_bound(pool)
        return bound is not None and self.tenant_busy(pool, tenant) + slots > bound

    def refuse_if_full(self, tenant: str) -> None:
        """The 429 of :meth:`admit`, before the request's body is read or parsed, when no
        model has a slot for ``tenant`` on a ready worker: every slot busy, or the
        tenant's share of them (a model whose workers are all starting is left to
        :meth:`admit`, which waits for them)."""
        blocked = []
        for pool in self.pools.values():
            if not any(w.ready for w in pool):
                return
            if self._tenant_full(pool, tenant):
                blocked.append("tenant")
            elif not any(w.free_slots for w in pool):
                blocked.append("full")
            else:
                return
        if blocked and all(b == "tenant" for b in blocked):
            raise tenant_busy_error(None)
        if blocked:
            raise ApiError(429, "Every slot of this server's models is busy; retry later.",
                           type="rate_limit_error", code="no_slot_available",
                           headers={"Retry-After": str(RETRY_AFTER_S)})

    async def admit(self, model: str, tenant: str, text: str, session: str,
                    affinity: str = "", slots: int = 1) -> tuple[Worker, Flight]:
        """A slot for the request, or an :class:`ApiError`: 404 for an unknown model, 429
        (with Retry-After) when every ready worker is busy: never a queue. A request that
        finds no worker serving (all starting or restarting) waits for one, up to
        ``ready_wait_s``. ``session`` (the runtime's sticky session) or else ``affinity``
        (OpenAI's prompt_cache_key or user) prefers the worker that key last ran on.
        ``slots``: a request with n choices runs on n sequences of one worker. The
        tenant's share (:meth:`tenant_bound`) is checked first: a tenant at its bound gets
        its 429 while other tenants' requests are admitted."""
        pool = self.pools.get(model)
        if pool is None:
            raise ApiError(404, f"The model '{model}' does not exist; this server has: "
                                f"{', '.join(self.model_names())}.", param="model",
                           code="model_not_found")
        key = session or affinity
        session_key = f"{tenant}\x00{model}\x00{'s' if session else 'a'}\x00{key}"
        deadline = time.monotonic() + self.settings.supervision.ready_wait_s
        while True:
            try:
                owner = self.sessions.get(session_key) if key else None
                most = max((w.slots for w in pool if w.ready), default=slots)
                if slots > most:
                    raise ApiError(400, f"n={slots} needs {slots} sequences of one worker; "
                                        f"the workers of model '{model}' have {most}.",
                                   param="n", code="invalid_value")
                bound = self.tenant_bound(pool)
                if bound is not None and slots > bound:
                    raise ApiError(400, f"n={slots} needs {slots} slots at once; a tenant "
                                        f"may hold at most {bound} of model '{model}'.",
                                   param="n", code="invalid_value")
                if self._tenant_full(pool, tenant, slots):
                    raise tenant_busy_error(model, bound)
                # Per tenant: another tenant's prompt says nothing of where this one's
                # KV lives (the runtime would not reuse it anyway).
                worker = choose(pool, tenant_text(tenant, text), owner, slots)
                break
            except NoFreeSlot:
                raise ApiError(429, f"All {sum(w.slots for w in pool if w.ready)} slots of "
                                    f"model '{model}' are busy; retry later.",
                               type="rate_limit_error", code="no_slot_available",
                               headers={"Retry-After": str(RETRY_AFTER_S)}) from None
            except NoReadyWorker:
                if self.stopping or all(w.process.state == FAILED for w in pool):
                    raise ApiError(503, f"No worker of model '{model}' can serve (crash "
                                        "loop; see the status endpoint).", type="server_error",
                                   code="worker_failed") from None
                if time.monotonic() > deadline:
                    raise ApiError(503, f"No worker of model '{model}' became ready within "
                                        f"{self.settings.supervision.ready_wait_s:g} s.",
                                   type="server_error", code="worker_not_ready",
                                   headers={"Retry-After": str(RETRY_AFTER_S)}) from None
                await asyncio.sleep(0.05)
        if key:
            self.sessions.set(session_key, worker.name)
        return worker, self.ledger.acquire(worker.name, tenant, slots)

    def release(self, worker: Worker, flight: Flight, served_text: str | None = None) -> None:
        """A request's slots back; ``served_text`` (its prompt and reply, whose KV the
        worker now holds) remembered for routing, unless the worker failed it."""
        self.ledger.release(flight)
        if served_text is not None and flight.failure is None:
            worker.remember(tenant_text(flight.tenant, served_text))


def tenant_busy_error(model: str | None, bound: int | None = None) -> ApiError:
    """A 429 for a tenant holding its share of a model's slots (other tenants are still
    served)."""
    where = f"its {bound} slots of model '{model}'" if model is not None else \
        "its share of every model's slots"
    return ApiError(429, f"This key's tenant already holds {where} (the per-tenant bound); "
                         "retry when one of its requests ends.", type="rate_limit_error",
                    code="tenant_slots_busy", headers={"Retry-After": str(RETRY_AFTER_S)})

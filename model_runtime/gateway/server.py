"""The gateway's lifetime: the cache daemon it keeps (if any) serving, HTTP(S) listener up,
workers up, until SIGTERM or SIGINT; then the listener closes, requests in flight end,
every worker is stopped, then the daemon it started. The listener counts its connections
(:mod:`.connections`): over a cap, one is answered 503 at once."""

from __future__ import annotations

import asyncio
import logging
import signal
import ssl

from aiohttp import web

from .app import CONNECTIONS, build_app
from .connections import (
    BACKLOG,
    ConnectionGate,
    ConnectionSettingsError,
    connection_caps,
    file_limit,
)
from .fleet import Fleet
from .keys import ApiKeys
from .settings import GatewaySettings, split_listen

log = logging.getLogger("model_runtime.gateway")


def run(settings: GatewaySettings, keys: ApiKeys | None, tls: ssl.SSLContext | None) -> None:
    asyncio.run(serve(settings, keys, tls))


async def serve(settings: GatewaySettings, keys: ApiKeys | None,
                tls: ssl.SSLContext | None) -> None:
    host, port = split_listen(settings.listen)
    files = file_limit()
    try:
        total, per_client = connection_caps(settings.connections,
                                            sum(m.workers for m in settings.models), files)
    except ConnectionSettingsError as exc:
        raise SystemExit(str(exc)) from None
    fleet = Fleet(settings, keys)
    # handler_cancellation: a client that disconnects cancels its handler, which cancels
    # the worker's gRPC call, which frees the runtime's sequence and the gateway's slot.
    # lingering_time=0: a refused request's large body is not read and dropped after the
    # answer, the connection is closed (app.unread_body_or_close drains small ones).
    # keepalive_timeout: a request's headers must come this soon after the connection
    # opened or its last answer (aiohttp closes a connection idle that long, and one
    # still sending its headers is idle to it).
    app = build_app(fleet)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                           shutdown_timeout=5.0, lingering_time=0,
                           keepalive_timeout=settings.connections.header_timeout_s)
    # Each connection is counted, then served by aiohttp's request handler (runner.server).
    def handler() -> asyncio.Protocol:
        assert runner.server is not None  # (made by runner.setup, before any connection)
        return runner.server()

    gate = ConnectionGate(handler, total, per_client, fleet.metrics.connection_closed)
    app[CONNECTIONS] = gate  # (its requests' start and end make a connection busy, idle)
    fleet.metrics.watch_connections(gate)
    await runner.setup()
    listener: asyncio.Server | None = None
    try:
        problem = await fleet.start_cache()
        if problem is not None:
            raise SystemExit(f"cannot start a cache daemon at {settings.cache_address}: "
                             f"{problem} (--cache none runs without one)")
        try:
            listener = await asyncio.get_running_loop().create_server(
                gate, host, port, ssl=tls, reuse_address=True, backlog=BACKLOG)
        except OSError as exc:
            raise SystemExit(f"cannot listen on {settings.listen}: {exc.strerror or exc}") \
                from None
        scheme = "https" if tls else "http"
        bound = [f"{scheme}://{a[0] if ':' not in a[0] else f'[{a[0]}]'}:{a[1]}"
                 for a in (sock.getsockname() for sock in listener.sockets)]
        log.info("gateway listening on %s; models: %s; %d workers", " ".join(bound),
                 ", ".join(fleet.model_names()), len(fleet.workers))
        log.info("connections: at most %d open, %d from one address (open files: %d); "
                 "headers within %g s, bodies within %g s", total, per_client, files,
                 settings.connections.header_timeout_s, settings.connections.body_timeout_s)
        fleet.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("stopping: closing the listener, then the workers%s",
                 ", then the cache daemon" if fleet.cache_daemon else "")
        listener.close()
        await fleet.stop()
    finally:
        if listener is not None:
            listener.close()
        await runner.cleanup()
        if not fleet.stopping:  # failed before serving: nothing may be left running
            await fleet.stop()
    log.info("gateway stopped")

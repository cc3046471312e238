"""The gateway's lifetime: the cache daemon it keeps (if any) serving, HTTP(S) listener up,
workers up, until SIGTERM or SIGINT; then the listener closes, requests in flight end,
every worker is stopped, then the daemon it started."""

from __future__ import annotations

import asyncio
import logging
import signal
import ssl

from aiohttp import web

from .app import build_app
from .fleet import Fleet
from .keys import ApiKeys
from .settings import GatewaySettings, split_listen

log = logging.getLogger("model_runtime.gateway")


def run(settings: GatewaySettings, keys: ApiKeys | None, tls: ssl.SSLContext | None) -> None:
    asyncio.run(serve(settings, keys, tls))


async def serve(settings: GatewaySettings, keys: ApiKeys | None,
                tls: ssl.SSLContext | None) -> None:
    host, port = split_listen(settings.listen)
    fleet = Fleet(settings, keys)
    # handler_cancellation: a client that disconnects cancels its handler, which cancels
    # the worker's gRPC call, which frees the runtime's sequence and the gateway's slot.
    # lingering_time=0: a refused request's large body is not read and dropped after the
    # answer, the connection is closed (app.unread_body_or_close drains small ones).
    runner = web.AppRunner(build_app(fleet), handler_cancellation=True, access_log=None,
                           shutdown_timeout=5.0, lingering_time=0)
    await runner.setup()
    try:
        problem = await fleet.start_cache()
        if problem is not None:
            raise SystemExit(f"cannot start a cache daemon at {settings.cache_address}: "
                             f"{problem} (--cache none runs without one)")
        site = web.TCPSite(runner, host, port, ssl_context=tls)
        try:
            await site.start()
        except OSError as exc:
            raise SystemExit(f"cannot listen on {settings.listen}: {exc.strerror or exc}") \
                from None
        scheme = "https" if tls else "http"
        bound = [f"{scheme}://{a[0] if ':' not in a[0] else f'[{a[0]}]'}:{a[1]}"
                 for a in runner.addresses]
        log.info("gateway listening on %s; models: %s; %d workers", " ".join(bound),
                 ", ".join(fleet.model_names()), len(fleet.workers))
        fleet.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("stopping: closing the listener, then the workers%s",
                 ", then the cache daemon" if fleet.cache_daemon else "")
        await site.stop()
        await fleet.stop()
    finally:
        await runner.cleanup()
        if not fleet.stopping:  # failed before serving: nothing may be left running
            await fleet.stop()
    log.info("gateway stopped")

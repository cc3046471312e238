"""SGLang's server endpoints that sglang-router (and vllm-router, which shares its code)
probe or pass on, found by running them: ``GET /model_info`` and ``/server_info`` (what
sglang-router reads at registration; ``/get_model_info``, ``/get_server_info``: their
older names, still tried), ``/version``, ``/get_load`` (requests in flight) and ``POST
/flush_cache``, refused: the cache is its operator's (``kvcache prune``), not an HTTP
caller's. (``/health_generate`` is the application's ``/health``.)

No ``tokenizer_path``: the model is a GGUF, which a router's tokenizer cannot load (a
router that tokenizes by itself is given a directory made from it, README "Running a
fleet behind a router")."""

from __future__ import annotations

from aiohttp import web

from kvcache import __version__

from ...errors import ApiError
from ...pipeline.door import FLEET

__all__ = ["add_routes"]


async def model_info(request: web.Request) -> web.Response:
    models = request.app[FLEET].models()
    first = models[0] if models else {}
    return web.json_response({"model_path": first.get("path"), "tokenizer_path": None,
                              "served_model_name": first.get("id"),
                              "max_context_length": first.get("context_length"),
                              "is_generation": True, "models": [m["id"] for m in models]})


async def server_info(request: web.Request) -> web.Response:
    fleet = request.app[FLEET]
    models = fleet.models()
    first = models[0] if models else {}
    return web.json_response({"version": __version__, "model_path": first.get("path"),
                              "tokenizer_path": None, "served_model_name": first.get("id"),
                              "models": models, "workers": len(fleet.workers),
                              "workers_ready": sum(w.ready for w in fleet.workers)})


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": __version__})


async def load(request: web.Request) -> web.Response:
    workers = request.app[FLEET].workers
    return web.json_response({"load": sum(w.in_flight for w in workers)})


async def flush_cache(request: web.Request) -> web.Response:
    raise ApiError(403, "The prefix cache is not flushed over HTTP: its operator prunes it "
                        "(kvcache prune, kvcache evict).", type="permission_error",
                   code="flush_not_allowed")


def add_routes(app: web.Application) -> None:
    app.router.add_get("/model_info", model_info, name="model_info")
    app.router.add_get("/get_model_info", model_info, name="get_model_info")
    app.router.add_get("/server_info", server_info, name="server_info")
    app.router.add_get("/get_server_info", server_info, name="get_server_info")
    app.router.add_get("/version", version, name="version")
    app.router.add_get("/get_load", load, name="load")
    app.router.add_post("/flush_cache", flush_cache, name="flush_cache")

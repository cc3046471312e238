"""An OpenAI-compatible HTTP gateway over supervised ``model-runtime serve`` workers.

In layers, bottom up (tests/unit/test_gateway_layering.py holds them):

* ``workers``: the processes the gateway keeps (its workers and the cache daemon), the
  calls to a worker, the slot ledger, and cache-aware routing among a model's workers.
* ``fleet``: every model's pool of workers, shared by every tenant, and admission to their
  slots with each tenant's share.
* ``pipeline``: what every API's request goes through, once: the door (the body read
  within limits), the one internal request, rendering, the worker's events written,
  accounting, failures and cancellation (``pipeline/run.py``: start here).
* ``apis``: per API (OpenAI, Anthropic Messages, Responses), an adapter that converts its
  requests at the door, a formatter that writes its answers, and its routes; SGLang's
  probes, which routers call.
* ``app`` (middlewares, the gateway's own routes), ``server`` (its lifetime), ``command``
  (the command line).

Beside them: ``errors``, ``limits``, ``connections``, ``keys``, ``settings``, ``metrics``.

Kept free of imports: ``workers.spawn`` runs as ``python -m
model_runtime.gateway.workers.spawn`` before every worker, so this package (and
``workers``) must load in milliseconds.
"""

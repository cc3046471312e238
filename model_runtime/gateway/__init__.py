"""An OpenAI-compatible HTTP gateway over supervised ``model-runtime serve`` workers.

Modules, one concern each: ``command`` (the command line), ``settings`` (what to run),
``keys`` (API keys, TLS and the listener's rules), ``openai_api`` (request parsing,
response bodies, error bodies), ``spawn`` (the parent-death wrapper a worker is started
through), ``worker`` (one worker process: start, health, progress, restart), ``router``
(cache-aware choice among a model's workers), ``fleet`` (every model's pool of workers,
shared by every tenant, and admission to their slots with each tenant's share),
``offload`` (the helper process that parses and renders large requests), ``ring``
(bounded log buffers), ``metrics`` (Prometheus), ``app`` (the HTTP routes) and
``server`` (the gateway's lifetime).

Kept free of imports: ``spawn`` runs as ``python -m model_runtime.gateway.spawn`` before
every worker, so this package must load in milliseconds.
"""

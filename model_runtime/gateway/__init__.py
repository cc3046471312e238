"""An OpenAI-compatible HTTP gateway over supervised ``model-runtime serve`` workers.

Folders, one concern each: ``apis`` (each API's requests read in, its answers written
out), ``pipeline`` (what every API's request goes through: the helper process that
parses and renders large requests), ``workers`` (the processes the gateway keeps: its
workers and the cache daemon, their supervision, and routing among a model's workers).
Beside them: ``command`` (the command line), ``settings`` (what to run), ``keys`` (API
keys, TLS and the listener's rules), ``fleet`` (every model's pool of workers, shared by
every tenant, and admission to their slots with each tenant's share), ``metrics``
(Prometheus), ``app`` (the HTTP routes) and ``server`` (the gateway's lifetime).

Kept free of imports: ``workers.spawn`` runs as ``python -m
model_runtime.gateway.workers.spawn`` before every worker, so this package (and
``workers``) must load in milliseconds.
"""

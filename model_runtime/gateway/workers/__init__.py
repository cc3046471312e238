"""The processes the gateway keeps (its workers and the cache daemon) and the calls to
them. Kept free of imports: ``spawn`` runs as ``python -m
model_runtime.gateway.workers.spawn`` before every worker."""

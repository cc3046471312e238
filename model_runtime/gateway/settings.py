"""What the gateway runs: models, workers per model, supervision windows, its listener.

Everything is checked when the settings are made, so a bad option or config file is refused
in one line before any worker starts.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from kvcache.config import default_dir

from .connections import ConnectionSettings
from .limits import Limits

DEFAULT_LISTEN = "127.0.0.1:8000"
# Anthropic's cache_control ttls and the seconds each pins its entry in the daemon.
CACHE_TTLS: Mapping[str, int] = {"5m": 300, "1h": 3600}
# A model's name is what clients put in "model": letters, digits and . _ - : /
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")


def default_responses_dir() -> Path:
    """Beside the cache daemon's default data (``~/.cache/kvcache``)."""
    return default_dir() / "gateway-responses"


@dataclass(frozen=True)
class ResponsesSettings:
    """Where stored responses live and how many are kept."""

    directory: Path | None = None  # None: default_responses_dir()
    max_count: int = 10_000
    max_bytes: int = 256 << 20
    ttl_s: float = 30 * 86400.0  # OpenAI keeps responses 30 days

    def __post_init__(self) -> None:
        for name in ("max_count", "max_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"responses {name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.ttl_s, (int, float)) or self.ttl_s <= 0:
            raise ValueError(f"responses ttl must be > 0 seconds, got {self.ttl_s!r}")

    @property
    def folder(self) -> Path:
        return (self.directory or default_responses_dir()).expanduser()


class SettingsError(ValueError):
    """A gateway setting or config file that cannot be used."""


@dataclass(frozen=True)
class ModelSpec:
    """One served model and the workers that serve it."""

    name: str
    path: Path
    workers: int = 1
    args: tuple[str, ...] = ()  # further `model-runtime serve` options for its workers

    def __post_init__(self) -> None:
        if not NAME_RE.match(self.name):
            raise SettingsError(f"model name {self.name!r}: use letters, digits and . _ - : / "
                                "(at most 128 characters)")
        if not isinstance(self.workers, int) or not 1 <= self.workers <= 64:
            raise SettingsError(f"model {self.name}: workers must be an integer from 1 to 64")
        for option in ("--socket", "--listen", "--cache", "--tenant", "--model"):
            if option in self.args:
                raise SettingsError(f"model {self.name}: {option} is set by the gateway (the "
                                    "tenant per request); remove it from the worker "
                                    "arguments")


@dataclass(frozen=True)
class Supervision:
    """How workers are watched and restarted.

    Liveness is judged by progress, not by a deadline on the request: a worker with a
    request in flight is stalled only when, for ``stall_window_s``, it has neither sent an
    event (a token) nor used CPU time (a prefill computes without sending anything).
    """

    stall_window_s: float = 60.0
    health_interval_s: float = 2.0
    health_timeout_s: float = 2.0
    health_failures: int = 3  # consecutive failed health checks before a restart
    start_timeout_s: float = 300.0  # from spawn to serving (the model loads meanwhile)
    kill_grace_s: float = 10.0  # SIGTERM (the runtime saves live sequences) → SIGKILL
    backoff_s: float = 0.5  # first restart delay, doubled per recent restart
    backoff_max_s: float = 30.0
    crash_loop_restarts: int = 5  # more restarts than this within the window: give up
    crash_loop_window_s: float = 300.0
    ready_wait_s: float = 60.0  # a request waits this long for a (re)starting worker
    log_lines: int = 200  # per worker, in the status endpoint's ring buffer

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise SettingsError(f"{f.name} must be a number >= 0, got {value!r}")
        for name in ("stall_window_s", "health_interval_s", "health_timeout_s",
                     "start_timeout_s"):
            if getattr(self, name) <= 0:
                raise SettingsError(f"{name} must be > 0")
        for name in ("health_failures", "log_lines"):
            if getattr(self, name) < 1:
                raise SettingsError(f"{name} must be >= 1")


@dataclass(frozen=True)
class GatewaySettings:
    models: tuple[ModelSpec, ...]
    listen: str = DEFAULT_LISTEN
    cache_address: str | None = None  # None: run the workers without a cache
    # The address is the default one: the gateway keeps a daemon there, starting one
    # when none answers (cache_daemon.py).
    keep_cache_daemon: bool = False
    supervision: Supervision = field(default_factory=Supervision)
    run_dir: Path | None = None  # where worker sockets live (default: a private temp dir)
    # tcp://HOST:PORT: worker i publishes its live sequences' KV events at PORT+i
    kv_events: str | None = None
    api_keys_file: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    insecure_tcp: bool = False
    default_tenant: str = ""  # the tenant of requests when no API keys are configured
    limits: Limits = field(default_factory=Limits)  # the work one request may ask for
    # how long a request may take to arrive, and how many connections may be open
    connections: ConnectionSettings = field(default_factory=ConnectionSettings)
    # The most slots of a model's pool one tenant may hold at once (None: half the pool's
    # slots rounded up with two tenants or more, no bound with one; see Fleet.tenant_bound)
    max_slots_per_tenant: int | None = None
    cache_ttls: Mapping[str, int] = field(default_factory=lambda: dict(CACHE_TTLS))
    responses: ResponsesSettings = field(default_factory=ResponsesSettings)  # stored ones

    def __post_init__(self) -> None:
        if not self.models:
            raise SettingsError("no model to serve")
        names = [m.name for m in self.models]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise SettingsError(f"model names must differ: {', '.join(dupes)} given twice")
        split_listen(self.listen)
        bound = self.max_slots_per_tenant
        if bound is not None and (isinstance(bound, bool) or not isinstance(bound, int)
                                  or bound < 1):
            raise SettingsError(f"max_slots_per_tenant must be an integer >= 1, got "
                                f"{bound!r}")
        self.worker_kv_events(0)  # a malformed endpoint is refused at start-up

    def worker_kv_events(self, index: int) -> str | None:
        """Worker ``index``'s KV events endpoint (None: off)."""
        if self.kv_events is None:
            return None
        host, _, port = self.kv_events.rpartition(":")
        if not port.isdigit() or not host.startswith("tcp://"):
            raise SettingsError(f"--kv-events {self.kv_events!r}: tcp://HOST:PORT expected")
        return f"{host}:{int(port) + index}"


def cache_ttl_seconds(values: tuple[str, ...]) -> dict[str, int]:
    """``--cache-ttl NAME=SECONDS`` over the defaults; only Anthropic's names (5m, 1h)."""
    ttls = dict(CACHE_TTLS)
    for value in values:
        name, _, seconds = value.partition("=")
        if name not in CACHE_TTLS or not seconds.isdigit() or int(seconds) < 1:
            raise SettingsError(f"--cache-ttl {value!r}: expected NAME=SECONDS with NAME one "
                                f"of {', '.join(CACHE_TTLS)} and SECONDS >= 1")
        ttls[name] = int(seconds)
    return ttls


def split_listen(listen: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) as (host, port)."""
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise SettingsError(f"listen address {listen!r} must be HOST:PORT (port 0: any free "
                            "one; [::1]:PORT for IPv6)")
    return host.strip("[]"), int(port)


def model_spec(value: str, workers: int, args: tuple[str, ...]) -> ModelSpec:
    """``--model [NAME=]PATH``; the name defaults to the file's name without ``.gguf``."""
    name, sep, path = value.partition("=")
    if not sep:
        name, path = "", value
    p = Path(path).expanduser()
    if not p.is_file():
        raise SettingsError(f"model file {p} does not exist")
    return ModelSpec(name=name or model_name(p), path=p, workers=workers, args=args)


def model_name(path: Path) -> str:
    return path.name.removesuffix(".gguf")


def load_config(path: Path) -> dict[str, Any]:
    """A JSON config file::

        {"models": [{"name": "smol", "path": "/m/smol.gguf", "workers": 2,
                     "args": ["--n-ctx", "8192"]}],
         "supervision": {"stall_window_s": 120}}

    Returns ``models`` as ModelSpecs and ``supervision`` as overrides; other keys are
    refused (a typo must not be ignored silently).
    """
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SettingsError(f"cannot read config {path}: {exc}") from None
    if not isinstance(data, dict):
        raise SettingsError(f"config {path}: must be a JSON object")
    unknown = set(data) - {"models", "supervision"}
    if unknown:
        raise SettingsError(f"config {path}: unknown keys {', '.join(sorted(unknown))}")
    models = []
    for i, entry in enumerate(data.get("models", [])):
        if not isinstance(entry, dict) or "path" not in entry:
            raise SettingsError(f"config {path}: models[{i}] needs at least a path")
        extra = set(entry) - {"name", "path", "workers", "args"}
        if extra:
            raise SettingsError(f"config {path}: models[{i}]: unknown keys "
                                f"{', '.join(sorted(extra))}")
        p = Path(entry["path"]).expanduser()
        if not p.is_file():
            raise SettingsError(f"config {path}: model file {p} does not exist")
        args = entry.get("args", [])
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise SettingsError(f"config {path}: models[{i}].args must be a list of strings")
        models.append(ModelSpec(name=entry.get("name") or model_name(p), path=p,
                                workers=entry.get("workers", 1), args=tuple(args)))
    overrides = data.get("supervision", {})
    names = {f.name for f in fields(Supervision)}
    if not isinstance(overrides, dict) or set(overrides) - names:
        raise SettingsError(f"config {path}: supervision takes {', '.join(sorted(names))}")
    return {"models": models, "supervision": overrides}


def with_supervision(base: Supervision, overrides: dict[str, Any]) -> Supervision:
    try:
        return replace(base, **overrides)
    except TypeError as exc:
        raise SettingsError(str(exc)) from None

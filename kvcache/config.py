"""Defaults and the environment variables that override them, in one place."""

from __future__ import annotations

import os
from pathlib import Path

ENV_DIR = "KVCACHE_DIR"
ENV_ADDRESS = "KVCACHE_ADDRESS"
SOCKET_NAME = "kvcache.sock"
# A unix socket path must fit sockaddr_un.sun_path (108 bytes with the NUL).
MAX_SOCKET_PATH = 107

# Messages: control RPCs carry token lists (4-5 bytes per token on the wire); blob bytes
# travel in chunks of at most CHUNK_BYTES. Anything larger is refused by gRPC itself with
# RESOURCE_EXHAUSTED before it reaches the service.
CHUNK_BYTES = 1 << 20
MAX_MESSAGE_BYTES = 16 << 20


def default_dir() -> Path:
    env = os.environ.get(ENV_DIR)
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvcache"


def default_address() -> str:
    env = os.environ.get(ENV_ADDRESS)
    if env:
        return env
    return f"unix:{default_dir() / SOCKET_NAME}"


def normalize_address(address: str) -> str:
    """Accept ``unix:/path``, a bare filesystem path, or ``host:port``."""
    if address.startswith(("unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:")):
        return address
    if address.startswith(("/", ".", "~")):
        return f"unix:{Path(address).expanduser().resolve()}"
    return address


def is_local(address: str) -> bool:
    return normalize_address(address).startswith("unix:")


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6addr]:PORT`` for IPv6) -> (host, port). Port 0 asks for any free
    port. Raises ValueError saying what is wrong: checked here because gRPC takes a port
    past 65535 modulo 65536 and listens on another one."""
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise ValueError(f"{text!r} is not HOST:PORT (e.g. 127.0.0.1:50051)")
    if host.startswith("["):
        if not host.endswith("]") or len(host) == 2:
            raise ValueError(f"{text!r}: an IPv6 address goes in brackets, e.g. [::1]:50051")
    elif ":" in host or "]" in host:
        raise ValueError(f"{text!r}: put an IPv6 address in brackets, e.g. [::1]:50051")
    if not (port.isascii() and port.isdigit()) or not 0 <= int(port) <= 65535:
        raise ValueError(f"{text!r}: the port must be a number from 0 to 65535 "
                         "(0: any free port)")
    return host, int(port)

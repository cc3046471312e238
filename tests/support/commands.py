"""The kvcache and model-runtime command lines run as users run them: real processes,
stdin not a terminal, or a pseudo-terminal of a chosen width."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvcache.client import Identity

# Wide enough that rich never shortens a 32-digit key in a table.
ENV = {**os.environ, "COLUMNS": "250"}
OTHER = Identity("fp-other-model", {"type_k": "f16"}, model_name="other.gguf")
RUNTIME = "model-runtime"  # a command starting with this word is model-runtime's
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07|\r")


def command_line(args: Sequence[str]) -> list[str]:
    """``("stats", ...)``: a kvcache command; ``("model-runtime", "warm", ...)``: that one."""
    if args[0] == RUNTIME:
        return [sys.executable, "-m", "model_runtime.cli", *args[1:]]
    return [sys.executable, "-m", "kvcache.cli", *args]


def cli_many(*commands: Sequence[str], timeout: float = 120) -> list[subprocess.CompletedProcess[str]]:
    """Run commands side by side; results in order. Their stdin is not a terminal, as in
    a script: destructive commands do not ask first."""
    procs = [subprocess.Popen(command_line(args), env=ENV, text=True,
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
             for args in commands]
    results = []
    for args, p in zip(commands, procs, strict=True):
        out, err = p.communicate(timeout=timeout)
        results.append(subprocess.CompletedProcess(list(args), p.returncode, out, err))
    return results


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return cli_many(args)[0]


def ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, f"{' '.join(command_line(result.args))} failed " \
        f"({result.returncode}):\n{result.stdout}{result.stderr}"
    return result.stdout


def cli_json(*args: str) -> Any:
    return json.loads(ok(cli(*args, "--json")))


def on_terminal(env: dict[str, str], *args: str, columns: int = 80,
                answer: str | None = None, before_answer: Callable[[], None] | None = None,
                timeout: float = 60.0) -> tuple[int, str]:
    """Run a command with stdin, stdout and stderr on a pseudo-terminal ``columns`` wide.
    When it asks (``[y/N]``), run ``before_answer`` and type ``answer``. Returns the exit
    code and everything the terminal showed (escape codes removed)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "kvcache.cli", *args], stdin=slave,
                            stdout=slave, stderr=slave, env={**env, "TERM": "xterm"},
                            start_new_session=True)
    os.close(slave)
    shown = b""
    answered = False
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.2)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the command exited and closed the terminal
                break
            if not chunk:
                break
            shown += chunk
            if not answered and b"[y/N]" in shown:
                answered = True
                if before_answer is not None:
                    before_answer()
                os.write(master, (answer or "n").encode() + b"\n")
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    return code, ANSI.sub("", shown.decode(errors="replace"))

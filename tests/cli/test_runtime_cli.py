"""The ``model-runtime`` command line: bad input, an unreachable cache, and completions on
a served runtime (``complete --server``).

Real processes throughout: the CLI as a subprocess (or click's runner where only its
checks run), ``model-runtime serve`` on the tiny generated GGUF with one thread, and a
real kvcache daemon wherever a cache is involved.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from click.testing import CliRunner
from grpc_health.v1 import health_pb2, health_pb2_grpc

from model_runtime.cli import main as runtime_main
from model_runtime.client import RuntimeClient
from model_runtime.config import RuntimeConfig, SettingError
from model_runtime.llama_backend import LlamaLoadError, LlamaModel, ModelFileError
from model_runtime.sampling import Sampling, SamplingParams
from tests.support.daemon_proc import DaemonProcess, wait_for

SYSTEM = "You are a terse assistant who answers in one short line. " * 8
NO_CACHE_WARNING = "running without a cache (requests run cold, saves are dropped)"
BACK = "is back; requests use the cache again"
LOCAL = ["--threads", "1", "--n-ctx", "1024", "--n-seq-max", "1"]


# --------------------------------------------------------------------------- helpers


def run_cli(*args: str | bytes, env: dict[str, str] | None = None,
            stdin: bytes | None = None) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([sys.executable, "-m", "model_runtime.cli", *args],
                            capture_output=True, input=stdin, timeout=180, check=False,
                            env={**os.environ, **(env or {})})
    return subprocess.CompletedProcess(result.args, result.returncode,
                                       result.stdout.decode(errors="replace"),
                                       result.stderr.decode(errors="replace"))


def error_line(result: Any, code: int) -> str:
    """The one line that says what went wrong; no traceback, the expected exit code."""
    output = result.stderr if isinstance(result, subprocess.CompletedProcess) else result.output
    exit_code = result.returncode if isinstance(result, subprocess.CompletedProcess) \
        else result.exit_code
    assert exit_code == code, output
    assert "Traceback" not in output
    errors = [line for line in output.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1, output
    return errors[0]


def invoke(*args: str) -> Any:
    """The CLI in this process: for checks that refuse before anything is loaded."""
    return CliRunner().invoke(runtime_main, list(args))


def complete_json(result: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def warnings_in(text: str) -> list[str]:
    return [line for line in text.splitlines() if NO_CACHE_WARNING in line]


class ServeProcess:
    """``model-runtime serve`` on the tiny model with one thread. Without ``socket`` it
    serves on its default socket, in ``KVCACHE_DIR`` (a short private dir)."""

    def __init__(self, model: Path, cache: str, log_path: Path, *,
                 default_socket: bool = False) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="rtc", dir="/tmp"))
        self.env = {**os.environ, "KVCACHE_DIR": str(self.dir)}
        self.socket = self.dir / ("model-runtime.sock" if default_socket else "rt.sock")
        where = [] if default_socket else ["--socket", str(self.socket)]
        self.args = [sys.executable, "-m", "model_runtime.cli", "serve", "--model", str(model),
                     "--cache", cache, *where, *LOCAL[:2], "--n-ctx", "1024",
                     "--n-seq-max", "2", "--continued-interval", "0"]
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"unix:{self.socket}"

    def start(self, timeout: float = 60.0) -> ServeProcess:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT,
                                         env=self.env)
        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(self.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while True:
                assert self.proc.poll() is None, f"serve exited:\n{self.log()}"
                try:
                    if health.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status == \
                            health_pb2.HealthCheckResponse.SERVING:
                        return self
                except grpc.RpcError:
                    pass
                assert time.monotonic() < deadline, f"serve did not come up:\n{self.log()}"
                time.sleep(0.05)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(autouse=True)
def private_kvcache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The runtime keeps its fingerprint memo in KVCACHE_DIR: the CLI runs here keep
    theirs in the test's temporary directory."""
    monkeypatch.setenv("KVCACHE_DIR", str(tmp_path / "kvcache-dir"))


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path,
           module_daemon: DaemonProcess) -> Iterator[tuple[DaemonProcess, ServeProcess]]:
    """A daemon and a ``model-runtime serve`` on its default socket, for this module."""
    tmp = tmp_path_factory.mktemp("served")
    serve = ServeProcess(tiny_model, module_daemon.address, tmp / "serve.log",
                         default_socket=True)
    try:
        serve.start()
        yield module_daemon, serve
    finally:
        serve.close()


@pytest.fixture
def system_file(tmp_path: Path) -> Path:
    path = tmp_path / "system.txt"
    path.write_text(SYSTEM)
    return path


# --------------------------------------------------------------------------- bad settings


@pytest.mark.parametrize("args, option, fragment", [
    (["--threads", "0"], "--threads", "integer >= 1, got 0"),
    (["--n-ctx", "0"], "--n-ctx", "integer >= 1, got 0"),
    (["--n-seq-max", "0"], "--n-seq-max", "integer from 1 to 256, got 0"),
    (["--n-seq-max", "257"], "--n-seq-max", "integer from 1 to 256, got 257"),
    (["--n-batch", "0"], "--n-batch", "integer >= 1, got 0"),
    (["--type-k", "q9"], "--type-k", "must be one of bf16, f16, f32, iq4_nl, q4_0"),
    (["--type-v", "q9"], "--type-v", "must be one of bf16, f16, f32, iq4_nl, q4_0"),
    (["--type-v", "q8_0"], "--type-v", "needs flash attention"),
    (["--continued-interval", "-1"], "--continued-interval", "integer >= 0, got -1"),
    (["--temperature", "-1"], "--temperature", "finite number >= 0, got -1.0"),
    (["--temperature", "nan"], "--temperature", "finite number >= 0, got nan"),
    (["--top-p", "2"], "--top-p", "> 0 and <= 1, got 2.0"),
    (["--top-p", "0"], "--top-p", "> 0 and <= 1, got 0.0"),
    (["--top-k", "-1"], "--top-k", "integer >= 0, got -1"),
    (["--seed", "-1"], "--seed", "integer from 0 to 18446744073709551615, got -1"),
    (["--max-tokens", "-1"], "--max-tokens", "integer >= 1, got -1"),
    (["--max-tokens", "0"], "--max-tokens", "integer >= 1, got 0"),
    (["--parent-key", "zz"], "--parent-key", "32 hex digits (a finish_key), got 'zz'"),
    (["--parent-key", "ab" * 15], "--parent-key", "32 hex digits"),
])
def test_bad_settings_are_usage_errors_naming_the_option(
        tiny_model: Path, args: list[str], option: str, fragment: str) -> None:
    result = invoke("complete", "--model", str(tiny_model), "--cache", "none",
                    "--prompt", "hi", *args)
    line = error_line(result, 2)
    assert f"Invalid value for '{option}'" in line and fragment in line


def test_serve_refuses_bad_settings_before_loading(tiny_model: Path) -> None:
    line = error_line(invoke("serve", "--model", str(tiny_model), "--cache", "none",
                             "--threads", "0"), 2)
    assert "Invalid value for '--threads'" in line


def test_a_draft_model_of_another_vocabulary_is_one_line_at_start(
        tiny_model: Path, tiny_hermes_model: Path, tmp_path: Path) -> None:
    # Found as the model loads, before the runtime serves anything: exit 2, one line
    # naming --draft-model and the difference.
    line = error_line(run_cli("serve", "--model", str(tiny_model), "--cache", "none",
                              "--socket", str(tmp_path / "rt.sock"), *LOCAL,
                              "--draft-model", str(tiny_hermes_model)), 2)
    assert "Invalid value for '--draft-model'" in line
    assert "does not share the vocabulary" in line and "tokens" in line
    line = error_line(invoke("complete", "--model", str(tiny_model), "--cache", "none",
                             "--prompt", "hi", "--speculative", "draft"), 2)
    assert "speculative" in line and "draft needs a draft model" in line


def test_settings_are_checked_by_the_config_itself() -> None:
    """The rules live in RuntimeConfig and SamplingParams: every caller gets them."""
    with pytest.raises(ValueError, match=r"^n_threads must be an integer >= 1, got 0$"):
        RuntimeConfig(n_threads=0)
    with pytest.raises(SettingError) as err:
        RuntimeConfig(type_k="q9")
    assert err.value.setting == "type_k" and "q8_0" in err.value.rule
    for bad in ({"cache_timeout_s": 0.0}, {"cache_check_interval_s": float("inf")},
                {"max_pending_saves": 0}, {"trim": -1}, {"shutdown_deadline_s": -1.0},
                {"n_ctx": 1.5}, {"n_ctx": True}, {"tenant": 3}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            RuntimeConfig(**bad)  # type: ignore[arg-type]
    RuntimeConfig(type_v="q8_0", flash_attn=True)  # llama.cpp decides about the model
    with pytest.raises(SettingError, match="seed"):
        Sampling(seed=2**64)
    with pytest.raises(SettingError, match="stop"):
        SamplingParams(stop=(3,))  # type: ignore[arg-type]


# --------------------------------------------------------------------------- bad GGUF files


def bad_gguf_bytes(kind: str, model: Path) -> bytes:
    good = model.read_bytes()
    return {"text": b"hello, I am not a model\n", "empty": b"", "short header": b"GGUF\x03\x00",
            "version 1": b"GGUF\x01\x00\x00\x00" + good[8:],
            "truncated copy": good[: len(good) // 2]}[kind]


@pytest.mark.parametrize("kind, fragment", [
    ("text", "is not a GGUF model (it does not start with the GGUF magic 'GGUF')"),
    ("empty", "is empty, not a GGUF model"),
    ("short header", "is truncated: it ends inside the GGUF header"),
    ("version 1", "is GGUF version 1; llama.cpp reads versions 2 and 3"),
    ("truncated copy", "the GGUF file is truncated or damaged"),
])
def test_a_bad_gguf_file_is_one_clear_line(tiny_model: Path, tmp_path: Path, kind: str,
                                           fragment: str) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(bad_gguf_bytes(kind, tiny_model))
    # The exception callers (e.g. ``model-runtime warm``) catch: a ValueError naming the file.
    with pytest.raises(ModelFileError) as err:
        LlamaModel(path)
    assert isinstance(err.value, ValueError) and isinstance(err.value, LlamaLoadError)
    assert str(path) in str(err.value) and fragment in str(err.value)
    for command in ("complete", "serve"):
        extra = ["--prompt", "hi"] if command == "complete" else []
        result = run_cli(command, "--model", str(path), "--cache", "none", *LOCAL, *extra)
        line = error_line(result, 2)
        assert "Invalid value for '--model'" in line and fragment in line


# --------------------------------------------------------------------------- bad prompts


def test_a_prompt_longer_than_the_context_is_one_line(tiny_model: Path) -> None:
    result = run_cli("complete", "--model", str(tiny_model), "--cache", "none", "--threads",
                     "1", "--n-ctx", "256", "--n-seq-max", "1", "--raw",
                     "--prompt", "word " * 400)
    line = error_line(result, 2)
    assert "prompt_too_long" in line and "does not fit the context of 256 tokens" in line


def test_a_max_tokens_given_must_fit_with_the_prompt(tiny_model: Path) -> None:
    """--max-tokens given: the prompt plus it must fit --n-ctx, or the request is refused
    (it used to be cut short with "length"); not given: 128 at most, fewer when the
    context fills first."""
    base = ["complete", "--model", str(tiny_model), "--cache", "none", "--threads", "1",
            "--n-ctx", "256", "--n-seq-max", "1", "--raw", "--prompt", "word " * 45]
    too_many = run_cli(*base, "--max-tokens", "250", "--json")
    line = error_line(too_many, 2)
    assert "prompt_too_long: a prompt of" in line and "and max_tokens 250 need" in line
    assert "the context holds 256 per sequence" in line
    n_prompt = int(line.split("a prompt of ")[1].split()[0])
    fits = complete_json(run_cli(*base, "--max-tokens", str(256 - n_prompt), "--json"))
    unbounded = complete_json(run_cli(*base, "--json"))  # room for fewer than 128
    assert fits["tokens"] == unbounded["tokens"]
    assert fits["prompt_tokens"] + len(fits["tokens"]) <= 256


def test_text_that_is_not_utf8_is_one_line(tiny_model: Path, tmp_path: Path) -> None:
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("Grüße aus Köln".encode("latin-1"))
    base = ["complete", "--model", str(tiny_model), "--cache", "none", *LOCAL]
    for args, option in ((["--system-file", str(latin1), "--prompt", "hi"], "--system-file"),
                         (["--prompt-file", str(latin1)], "--prompt-file"),
                         ([b"--prompt", b"caf\xe9"], "--prompt")):
        line = error_line(run_cli(*base, *args), 2)
        assert f"Invalid value for '{option}'" in line and "not" in line and "UTF-8" in line
    assert "byte 0xfc at offset 2" in error_line(run_cli(*base, "--prompt-file", str(latin1)), 2)
    missing = error_line(run_cli(*base, "--prompt-file", str(tmp_path / "nope.txt")), 2)
    assert "cannot read" in missing and "No such file" in missing
    assert "exactly one of --prompt and --prompt-file" in error_line(run_cli(*base), 2)
    # Standard input, read as UTF-8 like a file.
    record = complete_json(run_cli(*base, "--prompt-file", "-", "--max-tokens", "2", "--json",
                                   stdin="Grüße".encode()))
    assert record["completion_tokens"] == len(record["tokens"]) <= 2


# --------------------------------------------------------------------------- unreachable cache


def test_complete_says_once_that_the_cache_is_unreachable(tiny_model: Path, tmp_path: Path,
                                                          system_file: Path) -> None:
    address = f"unix:{tmp_path / 'nothing-here.sock'}"
    result = run_cli("complete", "--model", str(tiny_model), "--cache", address, *LOCAL,
                     "--system-file", str(system_file), "--prompt", "hi", "--max-tokens", "3",
                     "--json")
    record = complete_json(result)
    assert record["cache_hit_kind"] == "cold" and record["saves"] == []
    assert result.stderr.splitlines() == [
        f"kvcache: no cache daemon at {address}; {NO_CACHE_WARNING}"]


def test_complete_is_silent_with_a_cache_and_with_cache_none(
        tiny_model: Path, daemon: DaemonProcess, system_file: Path) -> None:
    args = ["complete", "--model", str(tiny_model), *LOCAL, "--system-file", str(system_file),
            "--prompt", "hi", "--max-tokens", "3", "--json"]
    cached = run_cli(*args, "--cache", daemon.address)
    assert complete_json(cached)["saves"] and cached.stderr == ""
    uncached = run_cli(*args, "--cache", "none")
    assert complete_json(uncached)["saves"] == [] and uncached.stderr == ""


def test_serve_reports_each_cache_outage_once_and_each_return(
        daemon_factory: Callable[..., DaemonProcess], tiny_model: Path, tmp_path: Path,
        system_file: Path) -> None:
    daemon = daemon_factory()
    daemon.stop()  # down when the runtime starts
    serve = ServeProcess(tiny_model, daemon.address, tmp_path / "serve.log")
    ask = ["complete", "--server", serve.address, "--system-file", str(system_file),
           "--prompt", "hi", "--max-tokens", "3", "--json"]
    probe_interval = RuntimeConfig().cache_check_interval_s
    try:
        serve.start()
        (warning,) = warnings_in(serve.log())
        assert f"kvcache: no cache daemon at {daemon.address}; {NO_CACHE_WARNING}" in warning
        daemon.start()
        wait_for(lambda: BACK in serve.log(), "the runtime to see the daemon back")
        assert complete_json(run_cli(*ask))["saves"], "the returned daemon takes saves"

        daemon.kill()
        wait_for(lambda: len(warnings_in(serve.log())) == 2, "a warning for the outage")
        # The outage goes on for several probes, and requests are served meanwhile:
        # still one warning for it.
        assert complete_json(run_cli(*ask))["finish_reason"] in ("length", "stop")
        deadline = time.monotonic() + 3 * probe_interval
        wait_for(lambda: time.monotonic() > deadline, "several probes", timeout=60)
        assert len(warnings_in(serve.log())) == 2
        daemon.start()
        wait_for(lambda: serve.log().count(BACK) == 2, "the runtime to see the daemon back")
        assert "Traceback" not in serve.log()
    finally:
        serve.close()


# --------------------------------------------------------------------------- --server


def test_complete_on_the_served_runtime_prints_what_a_local_run_prints(
        served: tuple[DaemonProcess, ServeProcess], tiny_model: Path,
        system_file: Path) -> None:
    daemon, serve = served
    request = ["--system-file", str(system_file), "--prompt", "Tell me a story",
               "--max-tokens", "6"]
    env = serve.env  # bare --server: the serve command's default socket
    remote = complete_json(run_cli("complete", "--server", *request, "--json", env=env))
    local = complete_json(run_cli("complete", "--model", str(tiny_model), "--cache", "none",
                                  *LOCAL, *request, "--json"))
    assert list(remote) == list(local)  # the same record, field for field
    assert remote["tokens"] == local["tokens"] and remote["text"] == local["text"]
    assert remote["completion_tokens"] == len(remote["tokens"])
    assert remote["saves"] and local["saves"] == []  # the served runtime has a cache
    # Its cache is used: another user message restores the system prompt.
    again = complete_json(run_cli("complete", "--server", serve.address, "--system-file",
                                  str(system_file), "--prompt", "Something else", "--json"))
    assert again["cache_delta"]["tokens_read"] > 0
    # Plain output is the text, as locally.
    text = run_cli("complete", "--server", serve.address, *request)
    assert text.returncode == 0 and text.stdout == local["text"] + "\n"


def test_complete_on_the_served_runtime_takes_the_same_request_options(
        served: tuple[DaemonProcess, ServeProcess], system_file: Path) -> None:
    _, serve = served
    request = ["complete", "--server", serve.address, "--system-file", str(system_file),
               "--prompt", "Go on", "--max-tokens", "8", "--json"]
    greedy = complete_json(run_cli(*request))
    assert len(greedy["text"]) >= 3
    stop = greedy["text"][1:3]
    stopped = complete_json(run_cli(*request, "--stop", stop))
    assert stopped["text"] == greedy["text"][: greedy["text"].find(stop)]
    sampled = ["--temperature", "0.8", "--top-p", "0.9", "--top-k", "40", "--seed", "7"]
    first = complete_json(run_cli(*request, *sampled, "--session-id", "a"))
    second = complete_json(run_cli(*request, *sampled, "--session-id", "b"))
    assert first["tokens"] == second["tokens"]
    assert (first["session_id"], second["session_id"]) == ("a", "b")
    with RuntimeClient(serve.address, timeout=60) as client:
        before = client.stats()["counters"]
        complete_json(run_cli(*request, "--parent-key", first["finish_key"]))
        after = client.stats()["counters"]
    tried = ("resolved_by_parent", "parent_key_unusable")
    assert sum(int(after.get(c, 0)) - int(before.get(c, 0)) for c in tried) == 1


def test_complete_on_the_served_runtime_refuses_bad_requests(
        served: tuple[DaemonProcess, ServeProcess]) -> None:
    _, serve = served
    too_long = run_cli("complete", "--server", serve.address, "--raw", "--prompt",
                       "word " * 1500, "--max-tokens", "2")
    line = error_line(too_long, 2)
    assert "prompt_too_long" in line and "the context holds 1024 per sequence" in line
    too_many = run_cli("complete", "--server", serve.address, "--raw", "--prompt", "hi",
                       "--max-tokens", "1024")
    line = error_line(too_many, 2)
    assert "prompt_too_long" in line and "and max_tokens 1024 need" in line
    assert "the context holds 1024 per sequence" in line
    local_only = invoke("complete", "--server", serve.address, "--prompt", "hi",
                        "--threads", "1", "--cache", "none")
    assert "--cache, --threads configure a runtime loaded by this command" in \
        error_line(local_only, 2)
    bad = invoke("complete", "--server", serve.address, "--prompt", "hi", "--top-p", "2")
    assert "Invalid value for '--top-p'" in error_line(bad, 2)


def test_complete_server_says_clearly_when_nothing_serves(
        served: tuple[DaemonProcess, ServeProcess], tmp_path: Path) -> None:
    daemon, _ = served
    missing = tmp_path / "no.sock"
    line = error_line(run_cli("complete", "--server", str(missing), "--prompt", "hi"), 1)
    assert f"no model runtime at unix:{missing} (no such socket" in line
    # A socket nobody accepts on (what a killed server leaves behind).
    stale = Path(tempfile.mkdtemp(prefix="rts", dir="/tmp")) / "stale.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(stale))
        line = error_line(run_cli("complete", "--server", f"unix:{stale}", "--prompt", "hi"), 1)
    shutil.rmtree(stale.parent)
    assert f"no model runtime answered at unix:{stale} within 3 s" in line
    # Something else serves there: the kvcache daemon.
    line = error_line(run_cli("complete", "--server", daemon.address, "--prompt", "hi"), 1)
    assert "does not serve completions" in line

"""The kernel sets a runtime chooses from (model_runtime/kernels.py): the deterministic set
by default, the fast one when asked for (by environment, or ``--kernels``, which starts
the command again with it), each named in the cache namespace; a set asked for and not
there is a clear error. Each case runs in a process of its own: llama.cpp is loaded once
per process."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from model_runtime import kernels
from model_runtime.v1 import runtime_pb2 as pb
from model_runtime.v1 import runtime_pb2_grpc as pb_grpc
from tests.support.daemon_proc import DaemonProcess
from tests.support.runtime_proc import RuntimeProcess

REPORT = """
import json, sys
from model_runtime import kernels
from model_runtime.config import RuntimeConfig
from model_runtime.llama_backend import batch_variant_options, build_options
from model_runtime.runtime import Runtime
with Runtime(sys.argv[1], cache_address=None, config=RuntimeConfig(n_threads=1, n_ctx=512,
                                                                    n_seq_max=1)) as rt:
    print(json.dumps({"kernels": rt.kernels, "batch_invariant": rt.batch_invariant,
                      "layout": rt.identity.kv_layout["kernels"],
                      "namespace": rt.identity.namespace.hex(),
                      "variant_options": batch_variant_options(),
                      "llamafile": build_options().get("LLAMAFILE"),
                      "repack": build_options().get("REPACK")}))
"""


# A token's scores after 700 cells, computed with flash attention in one batch and split
# three ways (alone after 699 cells: llama.cpp splits the cells across threads from 512 on;
# in a batch of 64+ rows: tiles), and what a runtime with flash attention reports.
FLASH_ATTN_SPLITS = """
import json, sys
import numpy as np
from model_runtime.config import RuntimeConfig
from model_runtime.llama_backend import (ContextParams, LlamaContext, LlamaModel,
                                         batch_variant_options)
from model_runtime.runtime import Runtime
path, n = sys.argv[1], 700
with LlamaModel(path) as model:
    toks = [(7 * i + 11) % (model.n_vocab - 20) + 10 for i in range(n)]

    def last_scores(cut):
        with LlamaContext(model, ContextParams(n_ctx=1024, n_batch=1024, n_ubatch=1024,
                                               n_seq_max=1, flash_attn=True)) as ctx:
            for a, b in ((0, cut), (cut, n)):
                ctx.decode(toks[a:b], list(range(a, b)), [0] * (b - a),
                           [False] * (b - a - 1) + [True])
            return ctx.logits(b - a - 1)

    whole = last_scores(n - 1)
    alike = all(np.array_equal(whole, last_scores(cut)) for cut in (1, 600, 690))
with Runtime(path, cache_address=None, config=RuntimeConfig(
        n_threads=1, n_ctx=512, n_seq_max=1, flash_attn=True)) as rt:
    print(json.dumps({"alike": alike, "batch_invariant": rt.batch_invariant,
                      "flash_attn": rt.identity.kv_layout["flash_attn"],
                      "variant_options": batch_variant_options(flash_attn=True)}))
"""


# A token's scores after 300 cells with two threads: decoded alone (single-column
# products, whose row tiles the deterministic set deals to the threads in turn), in a
# batch (tiles shared through a counter), and beside another sequence's token in one step
# (a single column per KV stream).
SPLIT_BETWEEN_THREADS = """
import json, sys
import numpy as np
from model_runtime import kernels
from model_runtime.llama_backend import ContextParams, LlamaContext, LlamaModel
path, n = sys.argv[1], 300
with LlamaModel(path) as model:
    toks = [(5 * i + 3) % (model.n_vocab - 20) + 10 for i in range(n)]
    with LlamaContext(model, ContextParams(n_ctx=1024, n_batch=512, n_ubatch=512,
                                           n_seq_max=2, n_threads=2)) as ctx:
        def last_scores(cut):
            ctx.clear()
            for a, b in ((0, cut), (cut, n)):
                ctx.decode(toks[a:b], list(range(a, b)), [0] * (b - a),
                           [False] * (b - a - 1) + [True])
            return ctx.logits(b - a - 1)

        def side_by_side():
            ctx.clear()
            for seq in (0, 1):
                ctx.decode(toks[:n - 1], list(range(n - 1)), [seq] * (n - 1),
                           [False] * (n - 1))
            ctx.decode([toks[n - 1]] * 2, [n - 1] * 2, [0, 1], [True, True])
            return ctx.logits(0), ctx.logits(1)

        whole = last_scores(n // 2)
        alone = last_scores(n - 1)
        step = side_by_side()
        print(json.dumps({"kernels": kernels.active(),
                          "alone": bool(np.array_equal(whole, alone)),
                          "beside": all(bool(np.array_equal(whole, s)) for s in step)}))
"""


def report(model: Path, script: str = REPORT, **env: str) -> dict[str, object]:
    environ = {k: v for k, v in os.environ.items()
               if k not in (kernels.ENV, kernels.LIB_PATH_ENV)}
    done = subprocess.run([sys.executable, "-c", script, str(model)], capture_output=True,
                          text=True, timeout=120, env={**environ, **env})
    assert done.returncode == 0, done.stderr[-2000:]
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.fixture(scope="module")
def sets_built() -> None:
    for name in kernels.CHOICES:
        assert kernels.built(name), f"{kernels.folder_of(name)}: run tools/build_kernels.sh"


def test_the_deterministic_set_runs_by_default_with_llamafile_and_computes_batches_alike(
        tiny_model: Path, sets_built: None) -> None:
    det = report(tiny_model)
    assert det["kernels"] == det["layout"] == "deterministic"
    assert det["batch_invariant"] is True and det["variant_options"] == []
    assert det["llamafile"] == "1" and det["repack"] is None  # tinyBLAS, patched


def test_the_fast_set_is_llama_cpp_s_defaults_and_another_namespace(
        tiny_model: Path, sets_built: None) -> None:
    det = report(tiny_model)
    fast = report(tiny_model, **{kernels.ENV: "fast"})
    assert fast["kernels"] == fast["layout"] == "fast"
    assert fast["llamafile"] == fast["repack"] == "1"
    # Not batch invariant, by its options (a start-up check of a short prompt finds its
    # splits alike; its reuse of longer prompts differs: tools/bench_warm_cold.py).
    assert fast["batch_invariant"] is False
    assert fast["variant_options"] == ["LLAMAFILE", "REPACK"]
    assert fast["namespace"] != det["namespace"]  # never restored by the other set


def test_flash_attention_is_computed_alike_alone_and_in_a_batch_by_the_deterministic_set(
        tiny_model: Path, sets_built: None) -> None:
    """The deterministic set computes flash attention by its vec-only path alone (patched),
    so a token's scores are the same alone or in a batch of any size after 512+ cells, and
    its states are named apart from llama.cpp's; llama-cpp-python's own build, alike
    without flash attention, is not with it, and says so whatever its start-up check of
    a short prompt found."""
    det = report(tiny_model, FLASH_ATTN_SPLITS)
    assert det == {"alike": True, "batch_invariant": True, "flash_attn": "vec",
                   "variant_options": []}
    spec = importlib.util.find_spec("llama_cpp")
    assert spec is not None and spec.origin is not None
    builtin = report(tiny_model, FLASH_ATTN_SPLITS,
                     **{kernels.LIB_PATH_ENV: str(Path(spec.origin).parent / "lib")})
    assert builtin["alike"] is False and builtin["batch_invariant"] is False
    assert builtin["flash_attn"] == "true" and builtin["variant_options"] == ["FLASH_ATTN"]


def test_the_deterministic_set_deals_a_single_token_s_products_to_two_threads_alike(
        tiny_model: Path, sets_built: None) -> None:
    """With two threads a token decoded alone, or beside another sequence's token, gets
    the scores it gets in a batch (tools/patches/ggml-llamafile-single-column.patch: a
    single column's row tiles go to the threads in turn, each element summed as in a
    batch)."""
    got = report(tiny_model, SPLIT_BETWEEN_THREADS)
    assert got == {"kernels": "deterministic", "alone": True, "beside": True}


def test_a_fast_set_not_built_is_a_clear_error(tiny_model: Path, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "model_runtime.cli", "complete", "--model", str(tiny_model),
         "--cache", "none", "--threads", "1", "--n-ctx", "256", "--max-tokens", "2",
         "--kernels", "fast", "--prompt", "Hello"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, kernels.DIR_ENV: str(tmp_path)})
    assert done.returncode == 1
    assert "fast" in done.stderr and "tools/build_kernels.sh" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("variable, value, named", [
    (kernels.ENV, "turbo", "deterministic, fast"),
    (kernels.WAIT_ENV, "doze", "brief, spin"),
], ids=["kernels", "threads wait"])
def test_an_unknown_choice_in_the_environment_is_a_clear_error(
        tiny_model: Path, variable: str, value: str, named: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "model_runtime.cli", "complete", "--model", str(tiny_model),
         "--cache", "none", "--threads", "1", "--n-ctx", "256", "--max-tokens", "2", "--prompt", "Hi"],
        capture_output=True, text=True, timeout=120, env={**os.environ, variable: value})
    assert done.returncode == 1
    assert value in done.stderr and named in done.stderr
    assert "Traceback" not in done.stderr


def test_serve_with_kernels_fast_starts_again_with_them(
        tiny_model: Path, tmp_path: Path, sets_built: None) -> None:
    daemon = DaemonProcess(tmp_path / "data").start()
    runtime = RuntimeProcess(tiny_model, daemon.address, tmp_path / "rt.log",
                             "--kernels", "fast")
    try:
        runtime.start()
        with grpc.insecure_channel(runtime.address) as channel:
            stats = pb_grpc.ModelRuntimeStub(channel).Stats(pb.RuntimeStatsRequest(),
                                                            timeout=10)
        assert stats.kernels == "fast" and stats.kv_layout["kernels"] == "fast"
        assert stats.threads_wait == "brief"  # (the default)
    finally:
        runtime.close()
        daemon.close()


# -- how llama.cpp's threads wait (OpenMP's wait policy, read by libgomp as it loads) ------

SPINCOUNT = """
import model_runtime.llama_backend  # loads llama.cpp, and with it libgomp
from llama_cpp import llama_cpp
"""


def gomp_spin_count(**env: str) -> str:
    """GOMP_SPINCOUNT as libgomp itself took it when llama.cpp loaded in a process of
    ``env`` (OMP_DISPLAY_ENV makes libgomp print what it read): how many times a thread
    spins at a barrier before it sleeps."""
    environ = {k: v for k, v in os.environ.items()
               if k not in (kernels.WAIT_ENV, kernels.OMP_WAIT_ENV, kernels.SPIN_COUNT_ENV)}
    done = subprocess.run([sys.executable, "-c", SPINCOUNT], capture_output=True, text=True,
                          timeout=120, env={**environ, "OMP_DISPLAY_ENV": "verbose", **env})
    assert done.returncode == 0, done.stderr[-2000:]
    (line,) = [x for x in done.stderr.splitlines() if "GOMP_SPINCOUNT" in x]
    return line.split("=")[1].strip().strip("'")


def test_llama_cpp_s_threads_spin_briefly_by_default_and_as_long_as_openmp_when_asked(
        ) -> None:
    assert gomp_spin_count() == "1000"
    assert gomp_spin_count(**{kernels.WAIT_ENV: "brief"}) == "1000"
    assert gomp_spin_count(**{kernels.WAIT_ENV: "spin"}) == "300000"  # OpenMP's default
    # The caller's own OpenMP settings are left as they are; ours, when given, win.
    assert gomp_spin_count(**{kernels.OMP_WAIT_ENV: "passive"}) == "0"
    assert gomp_spin_count(**{kernels.SPIN_COUNT_ENV: "50"}) == "50"
    assert gomp_spin_count(**{kernels.OMP_WAIT_ENV: "passive", kernels.WAIT_ENV: "brief"}) \
        == "1000"


def test_serve_with_threads_wait_spin_starts_again_so(tiny_model: Path, tmp_path: Path) -> None:
    runtime = RuntimeProcess(tiny_model, "none", tmp_path / "rt.log", "--threads-wait", "spin")
    try:
        runtime.start()
        with grpc.insecure_channel(runtime.address) as channel:
            stats = pb_grpc.ModelRuntimeStub(channel).Stats(pb.RuntimeStatsRequest(),
                                                            timeout=10)
        assert stats.threads_wait == "spin"
    finally:
        runtime.close()

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from harness.procs import Daemon

from kvcache.config import ENV_DIR
from tests.support import leftovers
from tests.support.daemon_proc import started_daemons

_CACHE_HOME = pytest.StashKey[str]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--campaign", action="store_true",
                     help="also run the tests marked campaign (the 1,000-kill crash campaign: "
                          "tens of minutes, up to 90)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``campaign`` run only with --campaign, whatever -m says (a plain run,
    ``-m slow`` and ``-m "not slow"`` all leave them out)."""
    if config.getoption("--campaign"):
        return
    campaign = [item for item in items if item.get_closest_marker("campaign")]
    if campaign:
        config.hook.pytest_deselected(items=campaign)
        items[:] = [item for item in items if not item.get_closest_marker("campaign")]


def pytest_sessionstart(session: pytest.Session) -> None:
    """The run's own kvcache directory: runtimes memoize model fingerprints in it (by
    default ~/.cache/kvcache, which a run then created and left behind); every process the
    suite starts inherits it."""
    session.stash[_CACHE_HOME] = tempfile.mkdtemp(prefix="kvxdg-")
    os.environ["XDG_CACHE_HOME"] = session.stash[_CACHE_HOME]
    os.environ.pop(ENV_DIR, None)
    leftovers.record(session)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A RAM-tier folder or a process the run left behind fails it (see
    tests/support/leftovers.py)."""
    shutil.rmtree(session.stash[_CACHE_HOME], ignore_errors=True)
    leftovers.check(session)


# --------------------------------------------------------------------------- daemons
# One way to have a real daemon: a test's own (``daemon``, ``daemon_factory``) or one all
# of a module's tests share (``module_daemon``, ``module_daemon_factory``; module-scoped
# fixtures such as a runtime or a gateway need one). A module's ``DAEMON_ARGS`` (a tuple
# of ``kvcache serve`` options, none by default) are what ``daemon`` and ``module_daemon``
# start theirs with.


@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator[Callable[..., Daemon]]:
    """Start real daemons: ``daemon_factory("--ram-bytes", "10M")``. All are killed after."""
    with started_daemons(tmp_path) as start:
        yield start


@pytest.fixture(scope="module")
def module_daemon_factory(tmp_path_factory: pytest.TempPathFactory
                          ) -> Iterator[Callable[..., Daemon]]:
    """``daemon_factory`` for daemons a module's tests share: killed after its last test."""
    with started_daemons(tmp_path_factory.mktemp("daemons")) as start:
        yield start


def daemon_args(request: pytest.FixtureRequest) -> tuple[str, ...]:
    return tuple(getattr(request.module, "DAEMON_ARGS", ()))


@pytest.fixture
def daemon(daemon_factory: Callable[..., Daemon], request: pytest.FixtureRequest) -> Daemon:
    """A daemon of the test's own, started with its module's DAEMON_ARGS."""
    return daemon_factory(*daemon_args(request))


@pytest.fixture(scope="module")
def module_daemon(module_daemon_factory: Callable[..., Daemon],
                  request: pytest.FixtureRequest) -> Daemon:
    """One daemon the module's tests share, started with its DAEMON_ARGS (tests sharing
    it keep apart by tenant or by prompt)."""
    return module_daemon_factory(*daemon_args(request), name="shared")


# --------------------------------------------------------------------------- tiny models
# Session-scoped GGUF files for the model-runtime tests (see tests/support/tiny_llama.py).


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random-weight llama GGUF (2 layers, n_embd 64)."""
    from tests.support.tiny_llama import make_tiny_model

    return make_tiny_model(tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_hermes_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a Hermes-style tool template (Qwen 2.5's shape)."""
    from tests.support.tiny_llama import make_tiny_model

    return make_tiny_model(tmp_path_factory, chat_template="hermes")


@pytest.fixture(scope="session")
def tiny_think_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with tools and <think> reasoning in its template (Qwen 3's shape)."""
    from tests.support.tiny_llama import make_tiny_model

    return make_tiny_model(tmp_path_factory, chat_template="think")


@pytest.fixture(scope="session")
def tiny_swa_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny sliding-window model (window 32, 4 layers)."""
    from tests.support.tiny_llama import make_tiny_swa_model

    return make_tiny_swa_model(tmp_path_factory, sliding_window=32)


@pytest.fixture(scope="session")
def tiny_hybrid_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny hybrid model (lfm2: short convolutions between attention layers)."""
    from tests.support.tiny_llama import make_tiny_hybrid_model

    return make_tiny_hybrid_model(tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_recurrent_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny recurrent model (mamba2)."""
    from tests.support.tiny_llama import make_tiny_recurrent_model

    return make_tiny_recurrent_model(tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_model_no_eog(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama model with its end-of-generation tokens made unreachable.

    The output rows of EOS and ``<|im_end|>`` are zeroed, so their logit is always 0
    while the best of the ~400 random logits is far above it: greedy generation only
    ends at ``max_tokens`` or the context's end. For tests that need a request to be
    still running (sticky_busy, shutdown mid-decode).
    """
    import gguf
    from harness.make_tiny_gguf import write_tiny_llama_gguf

    path = write_tiny_llama_gguf(tmp_path_factory.mktemp("tiny_no_eog") / "tiny-no-eog.gguf")
    reader = gguf.GGUFReader(path, "r+")
    (output,) = [t for t in reader.tensors if t.name == "output.weight"]
    for token in (2, 4):  # </s>, <|im_end|>: the model's only EOG tokens
        output.data[token, :] = 0.0
    output.data.flush()
    del reader
    return path

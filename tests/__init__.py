"""The test suite, in folders by what a test needs to run (README's "Tests" layout):

* ``unit``: no process of its own: pure functions, the store and llama.cpp in-process.
* ``daemon``: real ``kvcache serve`` processes over gRPC (auth, tenants, quotas, pieces...).
* ``remote``: the shared tier, against real ``redis-server`` processes.
* ``runtime``: the model runtime on the tiny generated models, in-process or served.
* ``gateway``: the OpenAI/Anthropic-compatible gateway as real processes.
* ``cli``: the ``kvcache`` and ``model-runtime`` command lines and the demo, as users run them.
* ``faults``: crashes, corruption, a full disk, daemon loss, load and fuzzed input.
* ``e2e``: the real SmolLM2 model; every test there is ``slow``.
* ``support``: what the tests share (processes, tiny models, fixtures); no tests.

Fixtures that tests in several folders use live in ``tests/conftest.py``.
"""

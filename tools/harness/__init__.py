"""What tests, tools and benchmarks share to set up and drive the system for real.

* ``procs``: every process they start (daemon, gateway, redis-server, the demo's stack).
* ``make_tiny_gguf``: tiny random-weight GGUF models that real llama.cpp loads.
* ``payloads``: payloads and blobs that follow from their tokens alone.
* ``system_prompt``: a long, realistic system prompt of a chosen size.

``tools/`` is on pytest's ``pythonpath`` (pyproject.toml), and a script in ``tools/`` has
its own folder on ``sys.path``: both import ``from harness.procs import Daemon``.
"""

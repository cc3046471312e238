"""What the tests share; no tests here. Processes come from ``harness.procs`` (tools/).

* ``daemon_proc``: the daemon as a process, ``wait_for``, its TCP address and token files.
* ``runtime_proc``, ``gateway_proc``, ``redis_proc``: the other real processes.
* ``entries``: entries on a daemon: test tokens and identity, raw Reserve/Write, files.
* ``tiny_llama``: the tiny generated models, prompts, prefill and greedy decode.
* ``runtime_calls``, ``warm_cold``: runtime configurations, texts and requests.
* ``remote_tier``: the shared tier from its daemons and from Redis.
* ``commands``: the command lines as real processes, piped or on a pseudo-terminal.
* ``chat_fixtures``, ``grammar_check``: chat templates, and grammars checked by llama.cpp.
* ``metrics``, ``counter_uses``: Prometheus scrapes, and counter names found in the source.
* ``kill_points``: a store killed in the middle of a removal (run as a child process).
* ``leftovers``: the session-end check that nothing was left behind (tests/conftest.py).
"""

"""Side-by-side TTFT benchmarks of kvcache, one entry for both:

    python tools/bench_compare.py [--quick] [--threads 2] [--repeats N] [--out-dir docs]
                                   [--no-wait] [--replot]

against llama-cpp-python's own prompt caches (``LlamaRAMCache``, ``LlamaDiskCache``), a
runtime without a cache and an in-process floor, over shared system prompts of about
1,000, 2,000 and 4,000 tokens: tools/bench_prompt_caches.py, writing
``OUT_DIR/bench_compare.json`` and ``.png``. With ``--workloads`` and/or ``--arms``:

    python tools/bench_compare.py --workloads shared,agent,chat,restart \\
        --arms kvcache,llama-server[,cold] [--llama-server PATH] [--system-tokens N]

against llama.cpp's own ``llama-server`` over four workloads: tools/bench_llama_server.py,
writing ``OUT_DIR/bench_llama_server.json`` and ``.png``. Each script's docstring says
what it measures and how; each also runs on its own.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import bench_llama_server
import bench_prompt_caches
from ttft_harness import add_common_options, add_replot_option


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Side-by-side TTFT benchmark: kvcache vs llama-cpp-python's own prompt "
                    "caches (or, with --workloads/--arms, vs llama-server).")
    add_common_options(parser, quick_help=bench_prompt_caches.QUICK_HELP,
                       repeats_help="warm requests per arm (default 7, side by side 15; "
                                    "--quick: 1)")
    bench_prompt_caches.add_options(parser)
    add_replot_option(parser)
    bench_llama_server.add_options(parser)
    args = parser.parse_args(argv)
    command = "python tools/bench_compare.py " + " ".join(sys.argv[1:] if argv is None
                                                           else argv)
    if args.workloads is not None or args.arms is not None:
        workloads, arms = bench_llama_server.selections(parser, args)
        bench_llama_server.run(args, workloads, arms, command)
    else:
        bench_prompt_caches.run(args, command)


if __name__ == "__main__":
    main()

"""``python tools/make_tiny_gguf.py OUT.gguf [--arch ...]``: the command line of
``harness.make_tiny_gguf`` (see there for the models it writes)."""

from __future__ import annotations

import sys

from harness.make_tiny_gguf import main

if __name__ == "__main__":
    sys.exit(main())

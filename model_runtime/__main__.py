"""``python -m model_runtime``: the ``model-runtime`` command."""

from .cli import main

main()

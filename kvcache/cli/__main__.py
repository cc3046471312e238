"""``python -m kvcache.cli``: the ``kvcache`` command."""

from . import main

if __name__ == "__main__":  # not when imported (a walk of the package's modules)
    main()

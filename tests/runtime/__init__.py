"""The model runtime on the tiny generated models: in-process, served, and warm against cold."""

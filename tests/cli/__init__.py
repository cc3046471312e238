"""The kvcache and model-runtime command lines and tools/demo.py, run as users run them."""

"""End to end on the real SmolLM2 model: every test here is slow (see conftest.py)."""

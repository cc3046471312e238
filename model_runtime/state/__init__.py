"""llama.cpp's per-sequence state format: read, cut, built, stored as pieces."""

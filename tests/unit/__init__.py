"""Tests that start no process: pure functions, the store on real LMDB and files,
llama.cpp in-process on the tiny generated models."""

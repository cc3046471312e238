"""Faults provoked for real: kill -9, corruption, a full disk, daemon loss, load and fuzzed
input."""

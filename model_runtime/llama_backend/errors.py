"""What llama.cpp's wrappers raise."""

from __future__ import annotations

__all__ = [
    "GrammarDeadEnd",
    "LlamaDecodeError",
    "LlamaError",
    "LlamaLoadError",
    "ModelFileError",
    "TokenizeCancelled",
]


class LlamaError(RuntimeError):
    """A llama.cpp call failed."""


class TokenizeCancelled(LlamaError):
    """The caller of a tokenization in pieces went away: the rest was not tokenized."""


class LlamaLoadError(LlamaError):
    """A model or context could not be created."""


class ModelFileError(LlamaLoadError, ValueError):
    """The model file is not a GGUF model llama.cpp can load (missing the GGUF magic, an
    unsupported GGUF version, truncated or damaged). The message names the file."""


class LlamaDecodeError(LlamaError):
    """``llama_decode`` returned non-zero.

    Codes: 1 = no KV slot for the batch (cache full), 2 = aborted, -1 = invalid batch
    (e.g. positions not consecutive with the sequence's cells), < -1 = fatal.
    On error the memory is restored to its state before the call.
    """

    def __init__(self, code: int) -> None:
        super().__init__(f"llama_decode failed with code {code}")
        self.code = code


class GrammarDeadEnd(LlamaError):
    """The grammar allows no token here (none of the vocabulary continues it)."""

"""Buffers that sequence states are copied into for saves, reused across saves.

A state is tens of megabytes (SmolLM2: 23 kB per token). Copied into fresh memory, every
page faults in on the model thread, and with transparent huge pages a fault can wait on
compaction: a 53 MB copy then takes 50-120 ms instead of 4-8 ms, once per ``continued``
save, in the middle of decoding (``tools/bench_runtime.py --decode-only`` shows it as
``outside_decode_ms_per_save``). So the model thread copies into a buffer taken from
here, the saver gives it back when the save is done, and buffers are kept up to a byte
budget (beyond it, a buffer is freed as before: an idle runtime does not hold a long
state's worth of memory forever).
"""

from __future__ import annotations

import threading

import numpy as np

DEFAULT_KEPT_BYTES = 256 << 20


class StateBuffers:
    """Thread-safe: the model thread takes, the saver thread gives back."""

    def __init__(self, max_kept_bytes: int = DEFAULT_KEPT_BYTES) -> None:
        self.max_kept_bytes = max_kept_bytes
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, size: int) -> np.ndarray:
        """A buffer of at least ``size`` bytes: the smallest kept one that fits, else a
        new one with room for the state to grow a little (it grows with every save)."""
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if len(b) >= size]
            if fits:  # (by index: list.remove would compare arrays elementwise)
                return self._free.pop(min(fits, key=lambda i: len(self._free[i])))
        return np.empty(size + size // 8, dtype=np.uint8)

    def give_back(self, buffer: np.ndarray) -> None:
        """Keep ``buffer`` for a later save, the largest first while over the budget
        (a larger buffer serves every smaller state)."""
        with self._lock:
            self._free.append(buffer)
            self._free.sort(key=len, reverse=True)
            kept = 0
            for i, b in enumerate(self._free):
                kept += len(b)
                if kept > self.max_kept_bytes:
                    del self._free[i:]
                    break

    def kept_bytes(self) -> int:
        with self._lock:
            return sum(len(b) for b in self._free)

"""Buffers that sequence states are copied into for saves, reused across saves.

A state is tens of megabytes (SmolLM2: 23 kB per token). Copied into fresh memory, every
page faults in on the model thread, and with transparent huge pages a fault can wait on
compaction: a 53 MB copy then takes 50-120 ms instead of 4-8 ms, once per ``continued``
save, in the middle of decoding (``tools/bench_runtime.py --decode-only`` shows it as
``outside_decode_ms_per_save``). So the model thread copies into a buffer taken from
here, the saver gives it back when the save is done, and buffers are kept up to a byte
budget (beyond it, a buffer is freed as before: an idle runtime does not hold a long
state's worth of memory forever). A take that leaves no kept buffer for a state of its
size has a spare made on a thread of its own, its pages faulted in there: several saves
in flight at once (four requests ending close together) otherwise had the model thread
copy into fresh memory, 70-80 ms instead of ~4, while every other stream waited.
"""

from __future__ import annotations

import threading

import numpy as np

DEFAULT_KEPT_BYTES = 256 << 20


class StateBuffers:
    """Thread-safe: the model thread takes, the saver thread gives back. ``spares``:
    make spares ahead (off only for tests of the rest)."""

    def __init__(self, max_kept_bytes: int = DEFAULT_KEPT_BYTES, spares: bool = True) -> None:
        self.max_kept_bytes = max_kept_bytes
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()
        self._spare_wanted = threading.Condition(self._lock)
        self._spare_size = 0  # of the spare to make next (0: none wanted)
        self._closed = False
        self._spares = threading.Thread(target=self._make_spares, name="state-buffers",
                                        daemon=True) if spares else None
        if self._spares is not None:
            self._spares.start()

    def take(self, size: int) -> np.ndarray:
        """A buffer of at least ``size`` bytes: the smallest kept one that fits, else a
        new one with room for the state to grow a little (it grows with every save)."""
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if len(b) >= size]
            # (by index: list.remove would compare arrays elementwise)
            taken = self._free.pop(min(fits, key=lambda i: len(self._free[i]))) if fits \
                else None
            if len(fits) <= 1 and self._spares is not None:  # none left for the next one
                self._spare_size = max(self._spare_size, size + size // 8)
                self._spare_wanted.notify()
        return taken if taken is not None else np.empty(size + size // 8, dtype=np.uint8)

    def _make_spares(self) -> None:
        while True:
            with self._lock:
                while not self._spare_size and not self._closed:
                    self._spare_wanted.wait()
                if self._closed:
                    return
                size, self._spare_size = self._spare_size, 0
            spare = np.empty(size, dtype=np.uint8)
            spare.fill(0)  # its pages faulted in here (numpy lets the GIL go meanwhile)
            self.give_back(spare)

    def close(self) -> None:
        """Stop making spares."""
        with self._lock:
            self._closed = True
            self._spare_wanted.notify()
        if self._spares is not None:
            self._spares.join(timeout=5)

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

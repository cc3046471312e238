"""Start a child of the gateway (a worker, the cache daemon it starts) so that it dies with
the gateway: ``python -m model_runtime.gateway.workers.spawn PARENT_PID -- COMMAND...``.

The gateway starts each child in a new session (its own process group, which the gateway
signals as a whole) through this wrapper, which asks the kernel to SIGKILL the process
when its parent dies (``prctl(PR_SET_PDEATHSIG)``) and then execs the command in place.
The setting survives ``execve``, so even a SIGKILLed gateway, which runs no clean-up,
leaves no child behind. It is done here rather than in a ``preexec_fn``, which runs Python
between ``fork`` and ``exec`` in a process whose other threads (gRPC's) hold locks.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> None:
    if len(argv) < 4 or argv[2] != "--":
        sys.exit("usage: python -m model_runtime.gateway.workers.spawn PARENT_PID -- COMMAND...")
    parent = int(argv[1])
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        sys.exit(f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(ctypes.get_errno())}")
    # The parent may have died before prctl took effect: then no signal will ever come.
    if os.getppid() != parent:
        sys.exit("the gateway exited before its child started")
    os.execvp(argv[3], argv[3:])


if __name__ == "__main__":
    main(sys.argv)

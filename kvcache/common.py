"""What the cache daemon (``kvcache``) and the model runtime (``model_runtime``) share: the
names of tiers, hit kinds and save reasons, owner-only folders and files, the gRPC server
both build, and the probe of a daemon's lock (whether a data directory is served).

A leaf: it imports nothing of either package (tests/unit/test_layering.py holds that), so the
runtime can use it without reaching into the daemon's server, and the daemon never
depends on the runtime. Each name is defined here once; the counters of both packages
(``kvcache.counters``, ``model_runtime.counters``) are named after these tuples.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # gRPC is imported when a server is built: the names stay import-light
    import grpc
    from grpc_health.v1 import health

# -- tiers: where a state was served from ---------------------------------------------------

TIER_RAM = "ram"  # the daemon's copies of hot entries, on a memory file system
TIER_DISK = "disk"  # the daemon's every entry (write-through)
TIER_REMOTE = "remote"  # the daemon fetched the entry from its shared tier for this hit
TIER_LIVE = "live"  # the runtime served the prompt from an idle sequence's KV in place
LOCAL_TIERS = (TIER_RAM, TIER_DISK)  # the daemon's own, on its host
RESTORE_TIERS = (*LOCAL_TIERS, TIER_REMOTE)  # what a state restored from the daemon came from

# -- hit kinds: how a request's prompt met the cache ----------------------------------------

HIT_EXACT = "exact"  # a saved state covered the whole prompt
HIT_PARTIAL = "partial"  # a saved state covered a shorter prefix of it
HIT_COLD = "cold"  # nothing restored: the whole prompt was prefilled
HIT_STICKY = "sticky"  # the session's own live sequence went on where it stopped
HIT_KINDS = (HIT_EXACT, HIT_PARTIAL, HIT_COLD, HIT_STICKY)

# -- save reasons: the save points the runtime takes ----------------------------------------
# The blob format (kvcache.blob.SAVE_REASONS) also knows "manual", for tools.

RUNTIME_SAVE_REASONS = ("cold", "prompt", "continued", "finish", "evict", "shutdown")

# -- files: owner-only whatever the umask ---------------------------------------------------
# What kvcache writes holds prompts (or says where they are): every folder it makes is
# 0700 and every file 0600, also under umask 000. Modes given to mkdir and open are masked
# by the umask but never widened, so asking for these is enough; Path.mkdir(parents=True)
# would make the missing parents with the umask's mode, hence make_private_dirs.
PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


def make_private_dirs(path: Path) -> None:
    """Make ``path`` and its missing parents, each owner-only. Folders that exist are
    left as they are (kvcache never changes the mode of a folder it did not make)."""
    missing = []
    while not path.exists() and not path.is_symlink() and path != path.parent:
        missing.append(path)
        path = path.parent
    for folder in reversed(missing):
        with contextlib.suppress(FileExistsError):  # made meanwhile: left as it is
            folder.mkdir(mode=PRIVATE_DIR_MODE)


def create_private_file(path: Path) -> int:
    """Create ``path`` owner-only (a file of that name goes first) and open it for
    writing; its descriptor."""
    path.unlink(missing_ok=True)
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE_MODE)


# -- gRPC ------------------------------------------------------------------------------------

# Status details travel percent-encoded in a trailer, and clients drop trailers over 8 KiB:
# an error echoing a 10 kB lease id or reason reached the caller as RESOURCE_EXHAUSTED
# "Stream removed" instead of its own status. 500 characters stay under the limit even
# when every one is a 4-byte UTF-8 sequence.
MAX_DETAILS = 500


def details(exc: Exception) -> str:
    """An error's message as a status detail: cut to MAX_DETAILS characters."""
    text = str(exc)
    return text if len(text) <= MAX_DETAILS else text[: MAX_DETAILS - 3] + "..."


def grpc_server(add_service: Callable[[grpc.Server], None], service_name: str,
                health_servicer: health.HealthServicer, workers: int,
                options: list[tuple[str, int]], interceptors: list[grpc.ServerInterceptor],
                thread_name_prefix: str = "") -> grpc.Server:
    """A server with the service, the standard health service and reflection (so generic
    gRPC tools can probe and discover it). Ports are added by the caller."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection

    server = grpc.server(ThreadPoolExecutor(max_workers=workers,
                                            thread_name_prefix=thread_name_prefix),
                         options=options, interceptors=interceptors)
    add_service(server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (service_name, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME), server)
    return server


def lock_is_held(path: Path) -> bool:
    """Whether some process holds an exclusive flock on ``path`` (a file or a folder; a
    missing one: no): a daemon's data directory lock, a RAM tier's folder. The probe is a
    shared lock taken and dropped at once."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False

"""Whether a process still runs: how a file or folder named after the process that writes it (``.tmp<PID>``,
``.building-<PID>``) is told stale once that process was killed without cleaning up (SIGKILL, SIGTERM, a lost
machine)."""

from __future__ import annotations

import os


def process_running(pid: int) -> bool:
    """Whether a process with this id exists on this machine (one this process may not signal still exists; an
    unknown answer counts as running, so nothing in use is taken for stale)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it exists; anything else: unknown
        return True
    return True

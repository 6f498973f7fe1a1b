"""Run one role as a child of ``lmserve serve``, bound to the parent's life.

    python -m launcher.supervised PARENT_PID worker|gateway [flags]

The parent stops its children in order on Ctrl-C or SIGTERM, but a parent killed outright
(SIGKILL, the OOM killer) runs no code at all. So each child asks the kernel for SIGTERM the
moment its parent dies (Linux ``PR_SET_PDEATHSIG``), or watches for it where that call does not
exist, and shuts down as it would on a plain SIGTERM. The request is made here, inside the child,
rather than in a ``preexec_fn`` between fork and exec, which is unsafe in a threaded parent.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
WATCH_INTERVAL = 0.5  # seconds between parent checks where prctl is unavailable


def die_with_parent(parent_pid: int) -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) == 0:
            # The parent may have died between our fork and the prctl call: then no signal
            # will ever come, and we have already been re-parented.
            if os.getppid() != parent_pid:
                os.kill(os.getpid(), signal.SIGTERM)
            return
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="parent-watch", daemon=True).start()


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(WATCH_INTERVAL)
    os.kill(os.getpid(), signal.SIGTERM)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 2 or not argv[0].isdigit():
        print("usage: python -m launcher.supervised PARENT_PID COMMAND [flags]", file=sys.stderr)
        return 2
    die_with_parent(int(argv[0]))
    from launcher.cli import main as cli_main
    return cli_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())

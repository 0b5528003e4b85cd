"""A process's resident memory and open descriptors, from /proc (Linux): what the soak and the
hostile test watch for leaks."""
from __future__ import annotations

import os


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))

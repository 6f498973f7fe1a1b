"""What a server's process tree holds (the peak sums of RSS and PSS, and each part's largest PSS),
sampled every 100 ms, and the CPU the rest of the machine uses meanwhile."""

from __future__ import annotations

import os
import threading
import time


class MemorySampler:
    """Samples the RSS sum of a process tree, and the CPU the rest of the machine uses meanwhile."""

    def __init__(self, pid: int | None, interval: float = 0.1):
        import psutil
        self._psutil = psutil
        self.pid = pid
        self.interval = interval
        self.peak = 0  # the largest sum of RSS over the process tree
        self.peak_pss = 0  # of PSS: each shared page counted once, split between its processes
        self.roles: dict[str, int] = {}  # each kind of process's largest PSS
        self.phase = "start"  # what the server is doing (a scenario's name), for ``phases``
        self.phases: dict[str, int] = {}  # the largest PSS sum during each phase
        self._server_cpu: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._started = 0.0
        self._busy0 = 0.0
        self._self0 = 0.0
        self._server_cpu0: dict[int, float] = {}

    def _busy(self) -> float:
        t = self._psutil.cpu_times()
        return sum(t) - t.idle - getattr(t, "iowait", 0.0)

    def _sample(self) -> None:
        if self.pid is None:
            return
        try:
            root = self._psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except self._psutil.Error:
            return
        rss = pss = 0
        for p in procs:
            try:
                mine = process_memory(p.pid) or (p.memory_info().rss, p.memory_info().rss)
                rss += mine[0]
                pss += mine[1]
                role = process_role(p.cmdline())
                self.roles[role] = max(self.roles.get(role, 0), mine[1])
                times = p.cpu_times()
                self._server_cpu[p.pid] = times.user + times.system
            except self._psutil.Error:
                pass
        self.peak = max(self.peak, rss)
        self.peak_pss = max(self.peak_pss, pss)
        self.phases[self.phase] = max(self.phases.get(self.phase, 0), pss)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval)

    def reset_peak(self) -> None:
        self.peak = self.peak_pss = 0
        self._sample()

    def start(self) -> MemorySampler:
        self._started = time.perf_counter()
        self._busy0 = self._busy()
        me = self._psutil.Process().cpu_times()
        self._self0 = me.user + me.system
        self._sample()
        self._server_cpu0 = dict(self._server_cpu)
        self._thread.start()
        return self

    def mark(self) -> tuple[float, float, float, float]:
        """A reading to measure the other processes' CPU use from (see ``other_cores``)."""
        me = self._psutil.Process().cpu_times()
        return time.perf_counter(), self._busy(), sum(self._server_cpu.values()), me.user + me.system

    def other_cores(self, since: tuple[float, float, float, float]) -> float | None:
        """Cores used on average by processes other than the server and this harness since ``since``."""
        if self.pid is None:
            return None
        self._sample()
        now = self.mark()
        wall = max(now[0] - since[0], 1e-9)
        return max(0.0, ((now[1] - since[1]) - (now[2] - since[2]) - (now[3] - since[3])) / wall)

    def stop(self) -> dict[str, float]:
        """Stop sampling; return the other processes' average CPU use (in cores) and the load average."""
        self._stop.set()
        self._thread.join()
        wall = max(time.perf_counter() - self._started, 1e-9)
        me = self._psutil.Process().cpu_times()
        server = sum(self._server_cpu.values()) - sum(self._server_cpu0.values())
        other = self._busy() - self._busy0 - server - (me.user + me.system - self._self0)
        if self.pid is None:  # a server we did not start: its CPU cannot be told apart
            return {"loadavg_1m": os.getloadavg()[0]}
        return {"other_cores": max(0.0, other / wall), "server_cores": server / wall,
                "loadavg_1m": os.getloadavg()[0]}


def process_memory(pid: int) -> tuple[int, int] | None:
    """(RSS, PSS) of a process in bytes, from /proc (None where it cannot be read). PSS splits
    each page among the processes that map it: summed over a stack of processes sharing
    libraries, it is the memory the stack holds; RSS sums count shared pages once per process."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as fh:
            fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in fh if line.split()[1:2]
                      and line.split()[1].isdigit()}
        return fields["Rss"], fields["Pss"]
    except (OSError, KeyError, ValueError, IndexError):
        return None


def process_role(cmdline: list[str]) -> str:
    """Which part of a server a process is: lmserve's worker, gateway or launcher, or the peer."""
    words = " ".join(cmdline)
    for role in ("worker", "gateway", "compile_ahead"):
        if f" {role}" in words or words.endswith(role):
            return role
    return "launcher" if "launcher" in words else os.path.basename(cmdline[0]) if cmdline else "?"

"""``lmserve serve``: the one-command local stack.

Starts ``--workers M`` workers (each a replica of the model on its own loopback port) and
``--gateways N`` gateways (sharing one port through SO_REUSEPORT, each routing between the
workers) as child processes, shows the model loading (a progress bar on a terminal), prints the
URL once every worker has loaded and every gateway answers, and takes them all down together:

- Ctrl-C or SIGTERM stops the gateways first, so in-flight streams finish while the workers
  still run (each gateway cuts what is left after ``--drain-timeout``), then the workers.
  A second Ctrl-C kills everything at once.
- A child that dies while the stack serves is named and started again (after a pause that
  grows while it keeps dying soon after each start); the others go on serving. A child that
  fails at start (a model that does not load, a port taken) stops the command, non-zero.
- The children run in their own process group (a terminal's Ctrl-C reaches only this process,
  which orders the shutdown) and die with this process even if it is killed outright
  (see ``launcher.supervised``).
"""

from __future__ import annotations

import argparse
import http.client
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from gateway.flags import GATEWAY_HEADER, MULTIPROCESS_ENV
from gateway.flags import build_parser as gateway_parser
from gateway.hosts import is_loopback
from launcher.flags import build_parser, to_argv
from shared.command_line import env_name
from shared.load_progress import ProgressBar, parse_status
from shared.wire_security import ephemeral_pair
from worker.flags import build_parser as worker_parser
from worker.flags import check_worker_flags, model_argument

POLL_INTERVAL = 0.1  # seconds between looks at the children
GATEWAYS_READY_WAIT = 10.0  # after the first healthy answer, how long to wait to hear from every gateway
WORKER_STOP_WAIT = 15.0  # a forward pass in progress finishes before the worker exits
RESTART_BACKOFF = 0.5  # seconds before a child that died is started again, doubled each quick death
RESTART_BACKOFF_MAX = 30.0
RESTART_RESET = 60.0  # a child that ran this long before dying is restarted without waiting longer


def _free_tcp_endpoints(count: int) -> list[str]:
    """``count`` distinct loopback endpoints nothing listens on (held open together while chosen)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [f"tcp://127.0.0.1:{sock.getsockname()[1]}" for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


@dataclass
class Child:
    name: str
    command: list[str]
    env: dict[str, str]
    gateway: bool
    proc: subprocess.Popen | None = None
    reported: bool = False  # its exit has been dealt with
    status_fd: int | None = None  # a worker's: our end of the pipe it reports loading on
    started_at: float = 0.0
    restarts: int = 0  # in a row, each after a short life; the backoff grows with them
    restart_at: float | None = None  # when a child that died is started again

    def spawn(self) -> None:
        """Start (or start again) the process; a worker gets a new status pipe."""
        # Own process group: a terminal's Ctrl-C reaches only us, and we stop the children in order.
        common = {"stdin": subprocess.DEVNULL, "process_group": 0, "env": self.env}
        if self.gateway:
            self.proc = subprocess.Popen(self.command, **common)
        else:
            status_read, status_write = os.pipe()
            self.proc = subprocess.Popen(self.command + ["--status-fd", str(status_write)],
                                         pass_fds=(status_write,), **common)
            os.close(status_write)
            os.set_blocking(status_read, False)
            self.status_fd = status_read
        self.started_at = time.monotonic()
        self.reported = False
        self.restart_at = None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, signum: int) -> None:
        if self.alive:
            self.proc.send_signal(signum)


@dataclass
class Stack:
    """The children and the state of the one loop that watches them."""

    args: argparse.Namespace
    children: list[Child] = field(default_factory=list)
    stop_requests: int = 0
    phase: str = "loading"  # loading -> starting -> serving -> draining -> stopping-worker -> done
    deadline: float = 0.0
    exit_code: int = 0
    # our ends of the workers' status pipes, each with what it has sent of its current line
    status: dict[int, bytearray] = field(default_factory=dict)
    status_of: dict[int, Child] = field(default_factory=dict)  # whose pipe each is
    loaded: int = 0  # workers that have said they are ready
    model_id: str = ""
    seen_gateways: set[str] = field(default_factory=set)  # ids of gateways that answered 200
    bar: ProgressBar | None = None
    selector: selectors.BaseSelector = field(default_factory=selectors.DefaultSelector)
    # the gateways' shared metrics files (gateway/metrics.py), removed when the stack ends
    metrics_dir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="lmserve-metrics-"))

    # --- starting ---------------------------------------------------------------------------

    def start(self) -> None:
        python = [sys.executable, "-m", "launcher.supervised", str(os.getpid())]
        # Secrets travel in the environment: a command line is visible to every local user. The
        # wire between the children is CURVE with key pairs made now, known to no one else.
        worker_public, worker_secret = ephemeral_pair()
        gateway_public, gateway_secret = ephemeral_pair()
        secrets = {env_name(flag): value for flag, value in (("--kv-secret", self.args.kv_secret),
                                                             ("--kv-store-password", self.args.kv_store_password),
                                                             ("--kv-store", self.args.kv_store))  # may hold a password
                   if value}
        worker_env = {**os.environ, **secrets, env_name("--wire-key"): worker_secret.decode(),
                      env_name("--wire-allow"): gateway_public.decode()}
        worker_argv = to_argv(worker_parser(), self.args,
                              skip=lambda a: a.dest in ("worker", "kv_secret", "kv_store_password", "kv_store"))
        endpoints = self.args.worker.split(",")
        for i, endpoint in enumerate(endpoints):
            name = "the worker" if len(endpoints) == 1 else f"worker {i + 1}"
            self._spawn(Child(name, python + ["worker", self.args.model, *worker_argv, "--worker", endpoint],
                              worker_env, gateway=False))
        # Gateways start at once: they answer 503 while the worker loads and find it by themselves.
        # The API key travels in the environment: a command line is visible to every local user.
        gateway_env = {**os.environ, env_name("--api-key"): ",".join(self.args.api_key),
                       env_name("--wire-key"): gateway_secret.decode(), env_name("--worker-key"): worker_public.decode()}
        # gateways sharing the port keep their metrics in one directory, and each reports the sum
        gateway_env[MULTIPROCESS_ENV] = self.metrics_dir
        gateway_argv = to_argv(gateway_parser(), self.args, skip=lambda a: a.dest == "api_key")
        for i in range(self.args.gateways):
            self._spawn(Child(f"gateway {i + 1}", python + ["gateway", *gateway_argv], gateway_env, gateway=True))
        self.bar = ProgressBar(sys.stderr, f"loading {os.path.basename(self.args.model)}") \
            if sys.stderr.isatty() else None
        if self.bar is None:
            print(f"lmserve serve: loading {self.args.model}", file=sys.stderr, flush=True)

    def _spawn(self, child: Child) -> None:
        child.spawn()
        if child not in self.children:
            self.children.append(child)
        if child.status_fd is not None:
            self.status[child.status_fd] = bytearray()
            self.status_of[child.status_fd] = child
            self.selector.register(child.status_fd, selectors.EVENT_READ)

    # --- the loop -----------------------------------------------------------------------------

    def run(self) -> int:
        try:
            while self.phase != "done":
                if self.phase in ("loading", "starting", "serving") and self.stop_requests:
                    self._begin_stop()
                if self.stop_requests > 1:
                    self._kill_all()
                    self.exit_code = self.exit_code or 130
                    break
                if not self.status:
                    time.sleep(POLL_INTERVAL)
                else:
                    for key, _ in self.selector.select(POLL_INTERVAL):
                        self._read_status(key.fd)
                self._check_children()
                self._advance()
        finally:
            self._close_status()
            self._kill_all()
        return self.exit_code

    def _read_status(self, fd: int) -> None:
        """Read a worker's loading progress; the bar follows the first worker (the others load
        the same file at the same pace), and loading ends when every worker is ready."""
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return
        if not chunk:  # the worker closed the pipe (it exited); its exit code tells the rest
            self._close_status(fd)
            return
        buffer = self.status[fd]
        buffer += chunk
        *lines, rest = bytes(buffer).split(b"\n")
        self.status[fd] = bytearray(rest)
        first = fd == min(self.status)
        for line in lines:
            entry = parse_status(line.decode("utf-8", "replace"))
            if entry is None:
                continue
            if self.phase != "loading":
                child = self.status_of.get(fd)
                if entry["event"] == "ready" and child is not None and child.restarts:
                    print(f"lmserve serve: {child.name} is back (pid {child.proc.pid})", file=sys.stderr, flush=True)
                continue
            if entry["event"] == "loading" and self.bar is not None and first:
                self.bar.update(int(entry["done"]), int(entry["total"]))
            elif entry["event"] == "compiling" and first:
                if self.bar is not None:
                    self.bar.update(1, 1)
                    self.bar.finish()
                    self.bar = None
                print(f"lmserve serve: compiling kernels for this CPU, once: {entry.get('what', '')}",
                      file=sys.stderr, flush=True)
            elif entry["event"] == "ready":
                self.loaded += 1
                self.model_id = str(entry.get("model", ""))
                if self.loaded < self.args.workers:
                    continue
                if self.bar is not None:
                    self.bar.update(1, 1)
                    self.bar.finish()
                self.phase, self.deadline = "starting", 0.0

    def _close_status(self, fd: int | None = None) -> None:
        for each in [fd] if fd is not None else list(self.status):
            self.selector.unregister(each)
            os.close(each)
            del self.status[each]
            child = self.status_of.pop(each, None)
            if child is not None and child.status_fd == each:
                child.status_fd = None  # closed: the number may be handed to another pipe

    def _check_children(self) -> None:
        now = time.monotonic()
        for child in self.children:
            if child.restart_at is not None and now >= child.restart_at and self.phase == "serving":
                if child.status_fd is not None:
                    self._close_status(child.status_fd)
                self._spawn(child)
                continue
            code = child.proc.poll()
            if code is None or child.reported:
                continue
            child.reported = True
            # Once a stop is under way (asked for, or caused by an earlier death) exits are ours.
            if self.phase in ("draining", "stopping-worker", "done"):
                continue
            if self.phase in ("loading", "starting"):  # a child that fails at start: the stack cannot start
                if self.bar is not None:
                    self.bar.finish()
                when = " while loading the model" if self.phase == "loading" and not child.gateway else ""
                print(f"lmserve serve: {child.name} (pid {child.proc.pid}) {describe_exit(code)}{when}; "
                      "stopping the others", file=sys.stderr, flush=True)
                self.exit_code = self.exit_code or (code if code > 0 else 1)
                self._begin_stop()
                continue
            # Serving: the others go on, and the one that died is started again. A child that dies
            # soon after each start waits longer each time; one that lived a while starts at once.
            child.restarts = 1 if now - child.started_at > RESTART_RESET else child.restarts + 1
            delay = min(RESTART_BACKOFF * 2 ** (child.restarts - 1), RESTART_BACKOFF_MAX)
            child.restart_at = now + delay
            print(f"lmserve serve: {child.name} (pid {child.proc.pid}) {describe_exit(code)}; the others go on, "
                  f"restarting it in {delay:g} s", file=sys.stderr, flush=True)

    def _advance(self) -> None:
        now = time.monotonic()
        if self.phase == "starting":
            self._probe_gateways(now)
        elif self.phase == "draining":
            gateways = [c for c in self.children if c.gateway and c.alive]
            if gateways and now < self.deadline:
                return
            for child in gateways:  # past --drain-timeout and then some: stop waiting
                child.signal(signal.SIGKILL)
            for worker in self.children:
                if not worker.gateway:
                    worker.signal(signal.SIGTERM)
            self.phase, self.deadline = "stopping-worker", now + WORKER_STOP_WAIT
        elif self.phase == "stopping-worker":
            if any(c.alive for c in self.children) and now < self.deadline:
                return
            self._kill_all()
            self.phase = "done"

    # --- readiness ----------------------------------------------------------------------------

    def _probe_gateways(self, now: float) -> None:
        """Ready when every gateway has answered /health with 200 (the kernel spreads new
        connections over the processes sharing the port), or a while after the first did."""
        status, gateway = health(self.args)
        if status == 200:
            self.seen_gateways.add(gateway)
            if not self.deadline:
                self.deadline = now + GATEWAYS_READY_WAIT
        if len(self.seen_gateways) >= self.args.gateways or (self.deadline and now >= self.deadline):
            self.phase = "serving"
            gateways = f"{self.args.gateways} gateway" + ("s" if self.args.gateways > 1 else "")
            workers = f"worker {self.args.worker}" if self.args.workers == 1 else \
                f"{self.args.workers} workers {self.args.worker}"
            print(f"lmserve serve: {self.model_id} ready on {url_of(self.args)} ({gateways}, {workers}); "
                  "Ctrl-C stops", flush=True)

    # --- stopping -----------------------------------------------------------------------------

    def _begin_stop(self) -> None:
        if self.bar is not None:
            self.bar.finish()
        for child in self.children:
            if child.gateway:
                child.signal(signal.SIGTERM)
        self.phase = "draining"
        self.deadline = time.monotonic() + self.args.drain_timeout + 5.0

    def _kill_all(self) -> None:
        for child in self.children:
            child.signal(signal.SIGKILL)
        for child in self.children:
            try:
                child.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass

    def request_stop(self, signum: int, _frame: object) -> None:
        self.stop_requests += 1

    def reload_keys(self, signum: int, _frame: object) -> None:
        """SIGHUP with --api-keys-file: every serving gateway reads the file again (one that is
        still starting, or starts again later, reads it as it starts)."""
        if self.phase == "serving":
            for child in self.children:
                if child.gateway:
                    child.signal(signal.SIGHUP)


def connect_host(args: argparse.Namespace) -> str:
    """Where this machine reaches the gateways: a wildcard bind is reached on loopback."""
    if args.host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if args.host == "::":
        return "::1"
    return args.host


def url_of(args: argparse.Namespace) -> str:
    host = args.host if args.host not in ("0.0.0.0", "::", "") else connect_host(args)
    return f"http://[{host}]:{args.port}" if ":" in host else f"http://{host}:{args.port}"


def health(args: argparse.Namespace, timeout: float = 2.0) -> tuple[int, str]:
    """(status of GET /health, the answering gateway's id); (0, "") when nothing answers."""
    host = connect_host(args)
    # On a non-loopback bind with --allow-host the Host guard accepts only those names.
    host_header = args.allow_host[0] if args.allow_host and not is_loopback(args.host) else host
    connection = http.client.HTTPConnection(host, args.port, timeout=timeout)
    try:
        connection.request("GET", "/health", headers={"Host": host_header})
        response = connection.getresponse()
        response.read()
        return response.status, response.getheader(GATEWAY_HEADER, "")
    except OSError:
        return 0, ""
    finally:
        connection.close()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_worker_flags(parser, args)
    if args.gateways < 1 or args.workers < 1:
        parser.error("--gateways and --workers must be at least 1")
    if args.conns < 1 or args.max_body < 1 or args.header_timeout <= 0:
        parser.error("--conns, --max-body and --header-timeout must be positive")
    from shared.default_model import resolve_model
    args.model = resolve_model(model_argument(parser, args))
    if args.draft:  # a Hub or known name is fetched here, once, with its progress on this terminal
        args.draft = resolve_model(args.draft)
    if args.worker and len(args.worker.split(",")) != args.workers:
        parser.error(f"--worker names {len(args.worker.split(','))} endpoint(s) for {args.workers} worker(s)")
    if any(endpoint.startswith("dns+") for endpoint in args.worker.split(",")):
        parser.error("--worker here names the endpoints the workers bind: tcp://host:port or ipc://path")
    args.worker = args.worker or ",".join(_free_tcp_endpoints(args.workers))
    if args.threads == 0 and args.workers > 1:  # the workers share this machine's cores
        args.threads = max(1, len(os.sched_getaffinity(0)) // args.workers)
    if not args.kv_store and not args.kv_cache_dir:
        from shared.default_model import cache_dir
        args.kv_cache_dir = str(cache_dir() / "kv")  # the embedded kvstore: a directory
    stack = Stack(args)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, stack.request_stop)
    # SIGHUP rereads the keys file where there is one (as a daemon reloads); else it stops, as a
    # closed terminal means
    signal.signal(signal.SIGHUP, stack.reload_keys if args.api_keys_file else stack.request_stop)
    try:
        stack.start()
        return stack.run()
    finally:
        shutil.rmtree(stack.metrics_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

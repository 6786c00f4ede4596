"""A private, short-lived local Flower: its own FLWR_HOME, SuperLink and (for a
simulation) Ray, the processes started in it, and ``flwr run`` against it.

Each launch uses free ports, a neutral working directory and its own FLWR_HOME, so runs
never pick up another checkout's code through a shared managed SuperLink (Ray actors put
the SuperLink's working directory first on ``sys.path``). ``flwr run`` gets a copy of the
app's sources (``app_staging``). Runtime dependency installation is off (it would ``uv
sync`` a fresh environment over the installed torch). The run's real status is read from
``flwr list`` (``flwr run --stream`` exits 0 even when the run failed), and everything
started here is stopped before returning, also on an exception or SIGTERM (which the CLI
turns into one). If this process dies without unwinding (SIGKILL), a small reaper
(``fedmech_flwr.tools.reaper``) kills what it started and removes its private folder.
"""

from __future__ import annotations

import errno
import http.client
import json
import logging
import os
import random
import re
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from fedmech_flwr.artifacts.folder import APP_DIR, LOGS_DIR
from fedmech_flwr.foundation.errors import StartError
from fedmech_flwr.tools.app_staging import stage_app
from fedmech_flwr.tools.finish import output_failure
from fedmech_flwr.tools.flwr_console import RUN_LOG, Console
from fedmech_flwr.tools.processes import stop_processes
from fedmech_flwr.tools.reaper import MARKER, kill_launch, start_reaper

log = logging.getLogger(__name__)

CONNECTION = "fedmech"
QUIET_ENV = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0.1",  # a submitted run starts within 0.1 s (default: 1 s)
    "RAY_USAGE_STATS_ENABLED": "0",
    "PYTHONUNBUFFERED": "1",
}
NODES_TIMEOUT_S = 120.0
"""How long ``deploy_local`` waits for its SuperNodes to come online."""
RAY_TIMEOUT_S = 120.0
"""How long a run waits for its private Ray head to start."""
RAY_READY = "Ray runtime started"
RAY_OVERLOADED = "The current node timed out during startup"
"""What ``ray start`` prints when its raylet did not register within Ray's fixed 30 s, as on
a loaded machine (``ray/_private/node.py``); ``wait_for_ray`` then starts the head again."""
SUPERLINK_PORTS = 5
"""How many ports a SuperLink is started on before giving up (``start_superlink``)."""
ADDRESS_IN_USE = os.strerror(errno.EADDRINUSE).lower()
"""How the SuperLink's log says that another program holds its port."""


@dataclass
class LaunchResult:
    run_id: int | None
    status: str
    """Flower's run status, e.g. ``finished:completed`` or ``finished:failed``."""
    logs_error: str | None = None
    """Why the logs could not be kept in the run folder (``keep_logs``), in one line."""

    @property
    def ok(self) -> bool:
        return self.status == "finished:completed"


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
"""The ports Linux hands to a socket that asks for any port (Ray's workers and clients, every
outgoing connection); on other systems IANA's 49152 and up."""
PORTS_FROM = 20000
"""The lowest port chosen here: above the ports services are known on (Ray's 6379 and 10001)."""
_ports = random.SystemRandom()  # not the random a seeded run or test controls: two launches must not agree


def free_port() -> int:
    """A port free now, on every address, chosen below the ephemeral range: a port the
    system hands out to whoever asks for any port can be taken between this choice and the
    bind of whoever it is for (a Ray beside this one lost its client server that way, and
    its run waited for it forever); below that range only a program that picks numbers
    itself, as this does, can. The port is released at once: should it be taken all the
    same, ``start_superlink`` starts again on another, and a private Ray head that loses
    one stops the run (``_watch_ray``)."""
    try:
        ephemeral = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 49152
    for _ in range(200):
        port = _ports.randrange(PORTS_FROM, max(ephemeral, PORTS_FROM + 1000))
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # every one tried was taken: whatever the system gives
        s.bind(("", 0))
        return s.getsockname()[1]


def _healthy(url: str, context: ssl.SSLContext | None) -> bool:
    """Whether ``url`` answers 200, as Flower's health check does; no answer, or any other
    (another server's, HTTP or not: a bad status line, a reset), is False."""
    try:
        with urllib.request.urlopen(url, timeout=1, context=context) as resp:
            return resp.status == 200
    except (OSError, http.client.HTTPException):
        return False


def _listens(pid: int, port: int) -> bool:
    """Whether process ``pid`` holds the socket listening on 127.0.0.1:``port``: its open
    files against the kernel's TCP table (Linux /proc; True where there is none)."""
    try:
        table = Path("/proc/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return True
    local = f"{int.from_bytes(socket.inet_aton('127.0.0.1'), sys.byteorder):08X}:{port:04X}"
    listening = {f"socket:[{row[9]}]" for row in map(str.split, table) if row[1] == local and row[3] == "0A"}
    try:
        return any(os.readlink(fd) in listening for fd in Path(f"/proc/{pid}/fd").iterdir())
    except OSError:  # a file closed meanwhile: asked again on the next poll
        return False


def _bin(name: str) -> str:
    """A Flower executable from this interpreter's environment (else from PATH)."""
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else (shutil.which(name) or name)


class LocalFlower:
    """A private FLWR_HOME with one SuperLink connection, its environment, and every
    process started in it (``close`` stops them all).

    A simulation's Ray is private too (its own RAY_TMPDIR; ``start_ray_head``), unless
    ``ray_address`` names a cluster: then ``ray.init`` gets it as ``RAY_ADDRESS`` (Flower's
    backend config has no address field) and the user's RAY_TMPDIR, where ``ray start``
    left the address that ``auto`` looks up.
    """

    def __init__(self, home: Path, port: int | None, ca: Path | None = None, ray_address: str | None = None) -> None:
        """``port``: the SuperLink's; None: a free one, chosen again should another program
        take it first (``start_superlink``)."""
        self.home, self.ca = home, ca
        self.port = port or free_port()
        self.port_chosen = not port
        self.ray_head: subprocess.Popen | None = None
        self.ray_args: list[str] = []
        """The private Ray head's command line (``start_ray_head``), kept to start it again."""
        self.ray_lost: str | None = None
        """Why the launch was stopped during a run: its private Ray head exited (``_watch_ray``)."""
        self.staged: dict[Path, Path] = {}
        self.running = False
        """A run is under way: ``close`` then gives its processes time to record how it ended."""
        self.closed = False
        self.reaper = start_reaper(home)
        (home / LOGS_DIR).mkdir()
        self.env = {**os.environ, **QUIET_ENV, "FLWR_HOME": str(home), "FEDMECH_PROJECT_DIR": str(APP_DIR),
                    MARKER: str(home)}
        if path := os.environ.get("PYTHONPATH"):  # its processes run in `home`: relative entries (plug-ins) resolved
            self.env["PYTHONPATH"] = os.pathsep.join(str(Path(p).resolve()) for p in path.split(os.pathsep))
        if ray_address:
            self.env["RAY_ADDRESS"] = ray_address
        else:  # a private Ray, whatever RAY_ADDRESS the user's shell may hold
            self.env.pop("RAY_ADDRESS", None)
            self.env["RAY_TMPDIR"] = str(home / "ray")
        # SuperLink and SuperNodes start flower-superexec, flwr-serverapp, ... by name.
        self.env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{self.env.get('PATH', '')}"
        self.env.setdefault("UV_CACHE_DIR", str(home / "uv"))
        self.procs: list[subprocess.Popen] = []

    def log_file(self, name: str) -> Path:
        return self.home / LOGS_DIR / f"{name}.log"

    def log_sizes(self) -> dict[str, int]:
        """How far each log has been written: ``keep_logs`` copies what comes after."""
        return {p.name: p.stat().st_size for p in (self.home / LOGS_DIR).glob("*.log")}

    def keep_logs(self, run_dir: Path | None, since: dict[str, int]) -> str | None:
        """Add what the logs gained since ``since`` to the run folder's ``logs/`` (a resumed
        run's to those of its earlier launches), else, when the run made no folder, show
        how the logs end. Returns why they could not be kept (a full disk), in one line."""
        if run_dir is None:
            return None
        if not run_dir.is_dir():
            log.warning("no run folder at %s; flwr run's log ends with:\n%s\nand the SuperLink's with:\n%s", run_dir,
                        self.tail(RUN_LOG), self.tail("superlink"))
            return None
        try:
            (run_dir / LOGS_DIR).mkdir(exist_ok=True)
            for source in sorted((self.home / LOGS_DIR).glob("*.log")):
                with open(source, "rb") as new, open(run_dir / LOGS_DIR / source.name, "ab") as out:
                    new.seek(since.get(source.name, 0))
                    shutil.copyfileobj(new, out)
        except OSError as err:
            return output_failure("the logs", err)
        return None

    def stage(self, app: Path) -> Path:
        """A copy of ``app``'s sources for ``flwr run`` (made once per app): the files an
        app bundle may hold, from every folder but hidden ones, ``__pycache__`` and those
        the app's ``.gitignore`` names. Flower builds the bundle from it as from the app
        itself, without walking a virtual environment of tens of thousands of files."""
        if app not in self.staged:
            self.staged[app] = stage_app(app, self.home / "apps-staged" / str(len(self.staged)))
        return self.staged[app]

    def start_ray_head(self, num_cpus: int | None) -> None:
        """Start a private Ray head (``ray start --block``, stopped with the rest) that
        every simulation of this SuperLink joins through ``RAY_ADDRESS``. It starts beside
        the SuperLink instead of inside each run; a run's ``ray.init`` waits for it."""
        port = free_port()
        self.env["RAY_ADDRESS"] = f"127.0.0.1:{port}"
        # Ray would start a worker per CPU for the first run's driver; Flower's actors never use
        # them (they need the job's runtime environment), so they only took CPU from the run's start
        self.env["RAY_prestart_worker_first_driver"] = "0"
        self.ray_args = [
            "ray", "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(port),
            "--include-dashboard", "false", "--disable-usage-stats", *(["--num-cpus", str(num_cpus)] if num_cpus else []),
            # `ray start` binds fixed ports that a second Ray on the machine would also take; these are free ones
            "--min-worker-port", "0", "--max-worker-port", "0", "--ray-client-server-port", str(free_port()),
            "--dashboard-agent-listen-port", str(free_port()), "--dashboard-port", str(free_port()),
            "--no-monitor",  # the autoscaler's monitor: a private head of fixed size has nothing to scale
        ]
        self.ray_head = self.start("ray", self.ray_args)

    def wait_for_ray(self, timeout: float = RAY_TIMEOUT_S) -> None:
        """Return once the private Ray head is up (at once when there is none or it is up).
        A head that gave up because its raylet did not register in time (``RAY_OVERLOADED``)
        starts again, once, with the same ports: the SuperLink and the run already hold its
        address."""
        deadline = time.monotonic() + timeout
        started_again = False
        while self.ray_head is not None and RAY_READY not in self.log_file("ray").read_text(errors="replace"):
            if self.ray_head.poll() is not None:
                if started_again or RAY_OVERLOADED not in self.tail("ray"):
                    raise RuntimeError(f"the private Ray head exited with code {self.ray_head.returncode}; see "
                                       f"{self.log_file('ray')}:\n{self.tail('ray')}")
                log.warning("the private Ray head did not start in Ray's 30 s (a loaded machine?); starting it again")
                self.procs.remove(self.ray_head)
                self.ray_head = self.start("ray", self.ray_args)
                started_again, deadline = True, time.monotonic() + timeout
            if time.monotonic() > deadline:
                raise RuntimeError(f"the private Ray head did not start within {timeout:.0f}s; see {self.log_file('ray')}")
            time.sleep(0.1)

    def alive(self) -> bool:
        """Whether every process started here still runs (a warm simulation can take a run)."""
        return not self.closed and all(proc.poll() is None for proc in self.procs)

    def start(self, name: str, args: list[str]) -> subprocess.Popen:
        """Start a Flower executable with its output in ``logs/<name>.log``."""
        with open(self.log_file(name), "w") as out:
            proc = subprocess.Popen([_bin(args[0]), *args[1:]], cwd=self.home, env=self.env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        return proc

    def start_superlink(self, *flags: str) -> None:
        """Start the SuperLink, wait until it answers on ``self.port``, and point the
        ``flwr`` connection (``config.toml``) at it. When another program took a port chosen
        here (Ray, starting beside, binds ports of its own), the SuperLink starts again on
        another, up to ``SUPERLINK_PORTS`` ports; a port the user gave is tried once."""
        tried = []
        while True:
            tried.append(self.port)
            proc = self.start("superlink", [
                "flower-superlink", *flags, "--host", "127.0.0.1", "--port", str(self.port),
                "--database", str(self.home / "state.db"), "--disable-runtime-dependency-installation",
            ])
            if self._wait_for_health(proc):
                break
            self.procs.remove(proc)
            if not self.port_chosen or len(tried) == SUPERLINK_PORTS:
                ports = ", ".join(map(str, tried))
                what = "run the command again" if self.port_chosen else "give another --port, or leave it out"
                raise StartError(f"flower-superlink could not start: port(s) {ports} taken by another program; {what}")
            log.info("port %d was taken by another program; starting flower-superlink on another port", self.port)
            self.port = free_port()
        tls = f'root-certificates = "{self.ca}"' if self.ca else "insecure = true"
        (self.home / "config.toml").write_text(
            f'[superlink]\ndefault = "{CONNECTION}"\n\n'
            f'[superlink.{CONNECTION}]\naddress = "127.0.0.1:{self.port}"\n{tls}\n'
        )

    def _wait_for_health(self, proc: subprocess.Popen, timeout: float = 60.0) -> bool:
        """Wait until the SuperLink ``proc`` answers on ``self.port``: True; False when it
        exited because another program holds the port. Only Flower's answer to ``/health``
        (200) from a port that ``proc`` holds counts (another Flower there would answer
        too); any other answer is not ready yet."""
        scheme, context = ("https", ssl.create_default_context(cafile=self.ca)) if self.ca else ("http", None)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                if ADDRESS_IN_USE in self.log_file("superlink").read_text(errors="replace"):
                    return False
                raise StartError(f"flower-superlink exited with code {proc.returncode}; see "
                                 f"{self.log_file('superlink')}:\n{self.tail('superlink')}")
            if _healthy(f"{scheme}://127.0.0.1:{self.port}/health", context) and _listens(proc.pid, self.port):
                return True
            time.sleep(0.3)
        raise StartError(f"flower-superlink did not become healthy within {timeout:.0f}s; see {self.log_file('superlink')}")

    def flwr(self, *args: str) -> subprocess.CompletedProcess:
        """A ``flwr`` command against this SuperLink (it must succeed)."""
        done = subprocess.run([_bin("flwr"), *args], capture_output=True, text=True, env=self.env, cwd=self.home, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"flwr {' '.join(args)} failed: {done.stdout.strip()} {done.stderr.strip()}")
        return done

    def wait_for_nodes(self, nodes: list[subprocess.Popen], timeout: float = NODES_TIMEOUT_S) -> None:
        """Wait until ``len(nodes)`` SuperNodes are online; fail as soon as one exits."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for i, proc in enumerate(nodes):
                if proc.poll() is not None:
                    raise RuntimeError(f"SuperNode {i} exited with code {proc.returncode}:\n{self.tail(f'supernode_{i}')}")
            listed = json.loads(self.flwr("supernode", "list", CONNECTION, "--format", "json").stdout)
            if sum(n.get("status") == "online" for n in listed.get("nodes", [])) >= len(nodes):
                return
            time.sleep(1)
        raise RuntimeError(f"{len(nodes)} SuperNodes did not come online within {timeout:.0f}s; logs in {self.home / LOGS_DIR}")

    def tail(self, name: str, lines: int = 20) -> str:
        path = self.log_file(name)
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.is_file() else ""

    def run(self, run_config: dict[str, str], federation_config: str | None = None,
            stream: TextIO | None = None, app: Path = APP_DIR, verbose: bool = False) -> LaunchResult:
        """``flwr run`` an app (this one by default), show its log on ``stream`` (default:
        stdout) through a ``Console``, keep all of it in ``logs/flwr_run.log``, and read
        the run's final status."""
        cmd = [_bin("flwr"), "run", str(self.stage(app)), CONNECTION, "--stream",
               "--run-config", " ".join(f"{k}={toml_quoted(v)}" for k, v in run_config.items())]
        if federation_config:
            cmd += ["--federation-config", federation_config]
        run_id = None
        proc = subprocess.Popen(cmd, cwd=self.home, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.procs.append(proc)  # stopped by close() too, should streaming end early (SIGTERM)
        self.running = True
        self.wait_for_ray()  # while flwr run builds and submits the app
        threading.Thread(target=self._watch_ray, args=(proc,), daemon=True).start()
        with open(self.log_file(RUN_LOG), "a") as log_file:
            console = Console(stream or sys.stdout, log_file, verbose)
            for line in proc.stdout:
                console.write(line)
                if run_id is None and (m := re.search(r"Successfully started run (\d+)", line)):
                    run_id = int(m.group(1))
        proc.wait()
        proc.stdout.close()
        self.procs.remove(proc)
        self.running = False
        if self.ray_lost:
            return LaunchResult(run_id, self.ray_lost)
        if run_id is None:
            return LaunchResult(None, f"not started (flwr run exited with {proc.returncode})")
        return LaunchResult(run_id, self._status(run_id))

    def _watch_ray(self, proc: subprocess.Popen) -> None:
        """Stop the launch should its private Ray head exit while ``proc`` (``flwr run``)
        runs: Flower's ``ray.init`` and its actors would wait for that Ray forever. Seen when
        another program took a port the head had been given (its client server's), the head
        stopping two seconds after it said it had started."""
        while proc.poll() is None and not self.closed:
            if self.ray_head is not None and self.ray_head.poll() is not None:
                said = " ".join(self.tail("ray", 2).split())
                self.ray_lost = (f"the private Ray head exited during the run (code {self.ray_head.returncode}: "
                                 f"{said or 'no message'}); its log is the run folder's logs/ray.log; run the "
                                 "command again (--resume continues a run that had started)")
                log.error(self.ray_lost)
                stop_processes(*(p for p in self.procs if p is not self.ray_head), grace_s=5.0)
                return
            time.sleep(0.5)

    def _status(self, run_id: int) -> str:
        out = subprocess.run([_bin("flwr"), "list", CONNECTION, "--run-id", str(run_id), "--format", "json"],
                             capture_output=True, text=True, env=self.env, cwd=self.home, timeout=120)
        try:
            return str(json.loads(out.stdout)["runs"][0]["status"])
        except (json.JSONDecodeError, KeyError, IndexError):
            return f"unknown ({out.stdout.strip() or out.stderr.strip()})"

    def close(self) -> None:
        """Stop every process started here, all at once (SIGTERM and a grace period while a
        run is under way, else SIGKILL: nothing is left to record), then whatever of the
        launch their parents left behind (by the reaper's rule), then the reaper, which
        has nothing left to do. A second call does nothing."""
        if self.closed:
            return
        self.closed = True
        stop_processes(*self.procs, grace_s=20.0 if self.running else 0.0)
        kill_launch(self.home)
        self.reaper.kill()
        self.reaper.wait()


_OPEN: set[LocalFlower] = set()
"""The local Flowers of this process that are running (``stop_all`` stops them)."""
_OPEN_LOCK = threading.Lock()


def opened(stack: ExitStack, flower: LocalFlower) -> LocalFlower:
    """Track ``flower`` until ``stack`` closes it."""
    with _OPEN_LOCK:
        _OPEN.add(flower)

    def close() -> None:
        with _OPEN_LOCK:
            _OPEN.discard(flower)
        flower.close()

    stack.callback(close)
    return flower


def stop_all() -> None:
    """Stop every run this process has going (``fedmech sweep`` on Ctrl-C or SIGTERM: its
    runs go on in worker threads, which signals do not reach)."""
    with _OPEN_LOCK:
        flowers = list(_OPEN)
    for flower in flowers:
        flower.close()


def toml_quoted(value: str) -> str:
    """A run-config value as a TOML string that Flower's ``--run-config`` parser keeps whole.

    Flower cuts ``key=value`` pairs with a regex that ends a quoted value at the next ``"``,
    escaped or not, so JSON's ``\\"`` inside a value (our overrides list) breaks it. TOML
    basic strings also accept ``\\u0022`` for ``"``, which that regex does not see.
    """
    return '"' + json.dumps(value)[1:-1].replace('"', "u0022") + '"'


def run_folder_of(run_config: dict[str, str]) -> Path | None:
    """The run folder ``fedmech run`` chose (or resumes); None for a user's own app."""
    folder = run_config.get("resume") or run_config.get("run-dir")
    return Path(folder) if folder else None

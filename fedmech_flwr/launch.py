"""Run an experiment with real ``flwr run`` on a private, short-lived local SuperLink.

Each launch starts its own ``flower-superlink --simulation`` on free ports, from a
neutral working directory, with its own FLWR_HOME, so runs never pick up another
checkout's code through a shared managed SuperLink (Ray actors put the SuperLink's
working directory first on ``sys.path``). Runtime dependency installation is off (it
would ``uv sync`` a fresh environment over the installed torch). The run's real status
is read from ``flwr list`` (``flwr run --stream`` exits 0 even when the run failed), and
everything started here is stopped before returning.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from fedmech_flwr.run_folder import APP_DIR

log = logging.getLogger(__name__)

CONNECTION = "fedmech"
QUIET_ENV = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    "PYTHONUNBUFFERED": "1",
}


@dataclass
class LaunchResult:
    run_id: int | None
    status: str
    """Flower's run status, e.g. ``finished:completed`` or ``finished:failed``."""

    @property
    def ok(self) -> bool:
        return self.status == "finished:completed"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bin(name: str) -> str:
    """A Flower executable from this interpreter's environment (else from PATH)."""
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else (shutil.which(name) or name)


def _wait_for_health(port: int, proc: subprocess.Popen, log_file: Path, timeout: float = 60.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"flower-superlink exited with code {proc.returncode}; see {log_file}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"flower-superlink did not become healthy within {timeout:.0f}s; see {log_file}")


def _run_status(env: dict[str, str], run_id: int, cwd: Path) -> str:
    out = subprocess.run(
        [_bin("flwr"), "list", CONNECTION, "--run-id", str(run_id), "--format", "json"],
        capture_output=True, text=True, env=env, cwd=cwd, timeout=120,
    )
    try:
        runs = json.loads(out.stdout)["runs"]
        return str(runs[0]["status"])
    except (json.JSONDecodeError, KeyError, IndexError):
        return f"unknown ({out.stdout.strip() or out.stderr.strip()})"


def _quote(value: str) -> str:
    """A run-config value as a TOML string that Flower's ``--run-config`` parser keeps whole.

    Flower cuts ``key=value`` pairs with a regex that ends a quoted value at the next ``"``,
    escaped or not, so JSON's ``\\"`` inside a value (our overrides list) breaks it. TOML
    basic strings also accept ``\\u0022`` for ``"``, which that regex does not see.
    """
    return '"' + json.dumps(value)[1:-1].replace('"', "u0022") + '"'


def launch(run_config: dict[str, str], num_supernodes: int, cpus_per_client: int, gpus_per_client: float) -> LaunchResult:
    """``flwr run`` this app with ``run_config`` on a fresh local simulation SuperLink."""
    with tempfile.TemporaryDirectory(prefix="fedmech-flwr-") as tmp:
        home = Path(tmp)
        port = _free_port()
        (home / "config.toml").write_text(
            f'[superlink]\ndefault = "{CONNECTION}"\n\n'
            f'[superlink.{CONNECTION}]\naddress = "127.0.0.1:{port}"\ninsecure = true\n'
        )
        env = {**os.environ, **QUIET_ENV, "FLWR_HOME": str(home), "RAY_TMPDIR": str(home / "ray"),
               "FEDMECH_PROJECT_DIR": str(APP_DIR)}
        # The SuperLink starts flower-superexec and flwr-simulation by name.
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        env.setdefault("UV_CACHE_DIR", str(home / "uv"))
        log_file = home / "superlink.log"
        superlink = subprocess.Popen(
            [_bin("flower-superlink"), "--insecure", "--simulation", "--isolation", "subprocess",
             "--host", "127.0.0.1", "--port", str(port), "--database", str(home / "state.db"),
             "--log-file", str(log_file), "--disable-runtime-dependency-installation"],
            cwd=home, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        try:
            _wait_for_health(port, superlink, log_file)
            run_args = " ".join(f"{k}={_quote(v)}" for k, v in run_config.items())
            federation = (
                f"num-supernodes={num_supernodes} client-resources-num-cpus={cpus_per_client} "
                f"client-resources-num-gpus={gpus_per_client}"
            )
            cmd = [_bin("flwr"), "run", str(APP_DIR), CONNECTION, "--stream",
                   "--run-config", run_args, "--federation-config", federation]
            run_id = None
            with subprocess.Popen(cmd, cwd=home, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
                for line in proc.stdout:
                    sys.stdout.write(line)
                    sys.stdout.flush()
                    if run_id is None and (m := re.search(r"Successfully started run (\d+)", line)):
                        run_id = int(m.group(1))
            if run_id is None:
                return LaunchResult(None, f"not started (flwr run exited with {proc.returncode})")
            return LaunchResult(run_id, _run_status(env, run_id, home))
        finally:
            _stop(superlink)


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux /proc; empty elsewhere). The SuperLink starts
    the simulation (and so Ray) in sessions of their own, out of reach of killpg."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _stop(proc: subprocess.Popen) -> None:
    """Stop the SuperLink and everything it started (simulation, Ray), SIGKILL if need be."""
    pids = [proc.pid, *_descendants(proc.pid)]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
            time.sleep(0.2)
        if not any(_alive(pid) for pid in pids):
            break
    proc.wait(timeout=10)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"  # zombie: gone
    except OSError:
        return not Path("/proc").is_dir()

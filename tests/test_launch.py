"""What ``flwr run`` is given: a copy of the app's sources that Flower bundles as it
bundles the app folder itself (each package where the app installs it), without walking
what the app ignores; the size of the private Ray it runs on; and a SuperLink port that
another program took first."""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import socketserver
import subprocess
import sys
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from flwr.cli.build import build_fab_from_disk

from conftest import REPO
from fedmech_flwr.artifacts.folder import APP_DIR
from fedmech_flwr.tools import local_flower
from fedmech_flwr.tools.app_staging import stage_app
from fedmech_flwr.tools.cli import EXIT_FAILED, main
from fedmech_flwr.tools.local_flower import LocalFlower
from fedmech_flwr.tools.simulation import private_ray_cpus


def bundled(app) -> dict[str, bytes]:
    """The files of the bundle Flower builds from ``app``, by path (its own ``.info`` left out)."""
    with zipfile.ZipFile(io.BytesIO(build_fab_from_disk(app))) as fab:
        return {name: fab.read(name) for name in fab.namelist() if not name.startswith(".info/")}


def test_the_staged_copy_of_this_app_bundles_its_files_with_the_builtin_plugins_where_they_install(tmp_path):
    """Byte for byte the app's files; the built-in plug-in folders under fedmech_flwr/builtin/
    (as pyproject.toml installs them), so no top-level ``clients`` or ``strategies`` in the
    bundle hides a user's own package in the ServerApp and the ClientApps."""
    staged = stage_app(APP_DIR, tmp_path / "app")
    moved = {"clients/": "fedmech_flwr/builtin/clients/", "strategies/": "fedmech_flwr/builtin/strategies/",
             "diagnostics/": "fedmech_flwr/builtin/diagnostics/"}

    def installed(name: str) -> str:
        return next((new + name[len(old):] for old, new in moved.items() if name.startswith(old)), name)

    app = {installed(name): data for name, data in bundled(APP_DIR).items()}
    assert "fedmech_flwr/builtin/strategies/fedavg.py" in app
    assert bundled(staged) == app


def test_staging_puts_a_folder_where_the_apps_pyproject_installs_it(tmp_path):
    app = tmp_path / "app"
    files = {"pyproject.toml": '[tool.setuptools.package-dir]\n"lib.extra.plugins" = "plugins"\n',
             "lib/__init__.py": "", "lib/extra/__init__.py": "", "plugins/__init__.py": "", "plugins/sub/a.py": "a = 1"}
    for name, text in files.items():
        (app / name).parent.mkdir(parents=True, exist_ok=True)
        (app / name).write_text(text)
    staged = stage_app(app, tmp_path / "staged")
    assert sorted(str(p.relative_to(staged)) for p in staged.rglob("*") if p.is_file()) == [
        "lib/__init__.py", "lib/extra/__init__.py", "lib/extra/plugins/__init__.py", "lib/extra/plugins/sub/a.py",
        "pyproject.toml"]


def test_staging_skips_ignored_hidden_and_cache_folders_and_keeps_what_flower_bundles(tmp_path):
    app = tmp_path / "app"
    files = {
        "pyproject.toml": "[project]\nname = 'x'\n", ".gitignore": "runs/\n*.log\nsecret.yaml\n", "LICENSE": "MIT",
        "pkg/__init__.py": "", "pkg/model.py": "x = 1", "pkg/conf.yaml": "a: 1", "pkg/notes.md": "n",
        "pkg/data.json": "{}", "pkg/weights.bin": "binary", "pkg/secret.yaml": "k: v", "pkg/out.log": "log",
        "runs/r1/metrics.json": "{}", ".venv/lib/site.py": "", ".git/hooks/x.py": "",
        "pkg/__pycache__/model.cpython-311.pyc": "",
    }
    for name, text in files.items():
        (app / name).parent.mkdir(parents=True, exist_ok=True)
        (app / name).write_text(text)
    staged = stage_app(app, tmp_path / "staged")
    assert sorted(str(p.relative_to(staged)) for p in staged.rglob("*") if p.is_file()) == [
        ".gitignore", "LICENSE", "pkg/__init__.py", "pkg/conf.yaml", "pkg/data.json", "pkg/model.py", "pkg/notes.md",
        "pyproject.toml"]
    assert (staged / "pkg" / "model.py").read_text() == "x = 1"


def test_a_private_ray_gets_no_more_cpus_than_the_clients_use_at_once(monkeypatch):
    """Flower starts a client actor per ``cpus_per_client`` CPUs of the cluster: a 3-client
    run on 32 cores gets a Ray of 3 CPUs (3 actors), not 32; a sweep worker's share caps it."""
    monkeypatch.setattr("os.cpu_count", lambda: 32)
    assert private_ray_cpus(3 * 1) == 3
    assert private_ray_cpus(3 * 4) == 12
    assert private_ray_cpus(100 * 1) == 32  # the whole machine, as before
    assert private_ray_cpus(100 * 1, share=8) == 8  # one of four sweep workers
    assert private_ray_cpus(2 * 1, share=8) == 2


# --- the SuperLink's port: taken by another program between choosing and binding it ------

@contextlib.contextmanager
def foreign_server() -> Iterator[int]:
    """A port held by a server that reads a request and answers a line that is not HTTP
    (as Ray's gRPC ports do): what the SuperLink's health check once met at start."""

    class Garbage(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            self.request.recv(65536)
            self.request.sendall(b"garbage\r\n\r\n")

    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Garbage)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def test_the_health_check_takes_any_answer_but_flowers_for_not_ready():
    with foreign_server() as port:
        assert not local_flower._healthy(f"http://127.0.0.1:{port}/health", None)  # a bad status line, not a traceback
    assert not local_flower._healthy(f"http://127.0.0.1:{port}/health", None)  # nobody there


@pytest.mark.skipif(not Path("/proc/net/tcp").is_file(), reason="needs Linux /proc")
def test_a_port_is_the_superlinks_only_while_its_process_holds_the_socket():
    """Another Flower on the port would answer the health check as well: who holds the
    listening socket decides."""
    with foreign_server() as port:
        assert local_flower._listens(os.getpid(), port)  # this process serves it
        other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            assert not local_flower._listens(other.pid, port)
        finally:
            other.kill()
            other.wait()
    assert not local_flower._listens(os.getpid(), port)


@pytest.mark.integration
def test_a_superlink_whose_port_another_program_took_starts_again_on_a_free_one(tmp_path, monkeypatch):
    with foreign_server() as taken:
        ports = iter([taken, local_flower.free_port()])
        monkeypatch.setattr(local_flower, "free_port", lambda: next(ports))
        (home := tmp_path / "home").mkdir()
        flower = LocalFlower(home, None)
        try:
            flower.start_superlink("--insecure")
            assert flower.port != taken and flower.alive()
            assert local_flower._healthy(f"http://127.0.0.1:{flower.port}/health", None)
            assert f'address = "127.0.0.1:{flower.port}"' in (home / "config.toml").read_text()
        finally:
            flower.close()


@pytest.mark.integration
def test_a_superlink_that_finds_every_port_taken_fails_in_one_line(tmp_path, monkeypatch, capsys):
    """``fedmech deploy-local`` (a SuperLink without Ray: seconds) tries ``SUPERLINK_PORTS``
    ports it chose, then ends in one line naming them, exit 1."""
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(local_flower, "SUPERLINK_PORTS", 2)
    with foreign_server() as first, foreign_server() as second:
        ports = iter([first, second])
        monkeypatch.setattr(local_flower, "free_port", lambda: next(ports))
        assert main(["deploy-local", "experiments/smoke.yaml", "--out", str(tmp_path)]) == EXIT_FAILED
    [line] = capsys.readouterr().err.splitlines()
    assert line == (f"error: flower-superlink could not start: port(s) {first}, {second} taken by another program; "
                    "run the command again")


def test_a_port_chosen_here_is_free_and_below_the_ports_the_system_hands_out():
    """A port the system hands to any socket asking for one (a Ray worker's) could be taken
    between the choice and the bind; below that range only programs that choose numbers can."""
    ephemeral = int(local_flower.EPHEMERAL_RANGE.read_text().split()[0])
    for port in {local_flower.free_port() for _ in range(20)}:
        assert local_flower.PORTS_FROM <= port < ephemeral
        with socket.socket() as s:
            s.bind(("", port))  # free on every address


def fake_ray(tmp_path: Path, *outputs: str) -> Path:
    """An executable standing in for ``ray``: its n-th start records its arguments, prints
    ``outputs[n]`` and exits 1, or, when that is Ray's ready line, waits to be stopped."""
    script = tmp_path / "ray"
    script.write_text(
        f"#!{sys.executable}\n"
        "import json, sys, time\nfrom pathlib import Path\n"
        f"calls = Path({str(tmp_path / 'calls.jsonl')!r})\n"
        "n = len(calls.read_text().splitlines()) if calls.exists() else 0\n"
        "with calls.open('a') as f:\n    f.write(json.dumps(sys.argv[1:]) + '\\n')\n"
        f"out = {list(outputs)!r}[n]\n"
        "print(out, flush=True)\n"
        f"sys.exit(1) if {local_flower.RAY_READY!r} not in out else time.sleep(60)\n")
    script.chmod(0o755)
    return script


def test_a_ray_head_that_timed_out_waiting_for_its_raylet_starts_again_once_on_the_same_port(tmp_path, monkeypatch,
                                                                                              caplog):
    """On a loaded machine ``ray start`` can give up on its own raylet (a fixed 30 s in
    Ray); the SuperLink and ``flwr run`` already hold the head's address, so the head
    starts again with the same arguments, once, and the run goes on. A second such
    failure, or any other, ends the launch naming the log."""
    overloaded = f"Exception: {local_flower.RAY_OVERLOADED}. This could happen because ..."
    monkeypatch.setattr(local_flower, "_bin", lambda name: str(fake_ray(tmp_path, overloaded, local_flower.RAY_READY + ".")))
    (home := tmp_path / "home").mkdir()
    flower = LocalFlower(home, None)
    try:
        flower.start_ray_head(2)
        flower.wait_for_ray(timeout=30)
        first, second = map(json.loads, (tmp_path / "calls.jsonl").read_text().splitlines())
        assert first == second and "--port" in first
        assert flower.alive() and flower.procs == [flower.ray_head]
        assert "starting it again" in caplog.text
    finally:
        flower.close()

    (tmp_path / "calls.jsonl").unlink()
    monkeypatch.setattr(local_flower, "_bin", lambda name: str(fake_ray(tmp_path, overloaded, overloaded)))
    (home := tmp_path / "home-2").mkdir()
    flower = LocalFlower(home, None)
    try:
        flower.start_ray_head(2)
        with pytest.raises(RuntimeError, match="the private Ray head exited with code 1; see .*ray.log"):
            flower.wait_for_ray(timeout=30)
        assert len((tmp_path / "calls.jsonl").read_text().splitlines()) == 2
    finally:
        flower.close()

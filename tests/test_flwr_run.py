"""End to end through real ``flwr run`` (SuperLink, Ray): the path users take.

Each run costs about 30-40 s on 2 cores (Ray start-up), so there are few: one that must
complete, one that must be reported as failed although ``flwr run`` itself exits 0, ones
killed mid-run then resumed, which must end as the completed one did, and the first-run
tutorial's run, which must print what the page shows; and bad input, refused before
Flower starts.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import assert_gone, assert_same_run, fenced_blocks, launch_processes_of, lost_bytes, once_per_session, shows
from fedmech_flwr.artifacts.folder import STATE_FILE, read_records, read_status
from fedmech_flwr.artifacts.liveness import process_alive
from fedmech_flwr.learning.arrays import load_arrays

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.integration


def fedmech_command(out: Path, *overrides: str) -> list[str]:
    cmd = [sys.executable, "-m", "fedmech_flwr.tools.cli", "run", "experiments/smoke.yaml", "--out", str(out)]
    for item in ("federation.num_clients=2", "federation.num_rounds=3", *overrides):
        cmd += ["--set", item]
    return cmd


def fedmech_run(out: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(fedmech_command(out, *overrides), cwd=REPO, capture_output=True, text=True, timeout=600)


def after_round_1(proc: subprocess.Popen, out: Path) -> None:
    """Return once the run ``proc`` writes under ``out`` has committed round 1 (or ended)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        runs = list(out.glob("*/" + STATE_FILE))
        if runs and int(load_arrays(runs[0])["round"]) >= 1:
            return
        time.sleep(0.05)


@pytest.fixture(scope="module")
def completed(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The completed run, made once per session: its folder and its process."""
    def make(folder: Path) -> None:
        done = fedmech_run(folder / "out")
        (folder / "process.json").write_text(json.dumps([done.returncode, done.stdout, done.stderr]))

    folder = once_per_session(tmp_path_factory, "flwr-run-completed", make)
    returncode, stdout, stderr = json.loads((folder / "process.json").read_text())
    return next((folder / "out").iterdir()), subprocess.CompletedProcess([], returncode, stdout, stderr)


def test_flwr_run_completes_and_writes_the_run_folder(completed):
    run_dir, done = completed
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    lines = done.stdout.splitlines()
    assert lines[0] == (f"fedmech run: smoke -> {run_dir} | 2 clients x 3 rounds | simulation on a private Ray, "
                        "1 CPU(s) per client")
    page = run_dir / "report" / "index.html"
    assert lines[-1] == (f"completed: {run_dir} | plots in {run_dir / 'plots'}, Flower's log in {run_dir / 'logs'} "
                         f"| page: {page}")
    assert page.is_file() and f"<h1>fedmech run {run_dir.name}: completed</h1>" in page.read_text()
    assert read_status(run_dir)["status"] == "completed"
    evals = read_records(run_dir, "eval")
    assert [r["round"] for r in evals] == [0, 1, 2, 3]
    clients = read_records(run_dir, "client")
    assert sorted((r["round"], r["partition_id"]) for r in clients) == [(r, p) for r in (1, 2, 3) for p in (0, 1)]
    # The console is quiet: a start line, one line per round (through Flower's log stream), an end line;
    # Flower's and Ray's whole log is in the run folder.
    assert [line.split(" | ")[0] for line in lines[1:-1]] == [f"round {r}/3" for r in range(4)]
    assert "round 3/3 | global test accuracy" in done.stdout and "| ETA " in lines[2]
    assert "Starting Flower Simulation" in (run_dir / "logs" / "flwr_run.log").read_text()
    env = json.loads((run_dir / "environment.json").read_text())
    assert env["packages"]["flwr"].startswith("1.42")


def test_the_first_run_page_shows_what_its_run_prints(tmp_path):
    """docs/tutorials/first-run.md's example output is what its ``fedmech run`` prints today,
    run as written from a folder that looks like the repository's root (the round lines'
    numbers exactly: a seeded run is reproducible; durations and the folder's time stamp
    may differ)."""
    found = fenced_blocks((REPO / "docs" / "tutorials" / "first-run.md").read_text())
    [i] = [i for i, (language, _, _, previous) in enumerate(found) if language == "text" and
           previous == "<!-- test: output -->"]
    language, command, _, _ = found[i - 1]
    assert language == "bash" and command == ".venv/bin/fedmech run experiments/smoke.yaml --out runs\n", command
    (tmp_path / "experiments").symlink_to(REPO / "experiments")
    done = subprocess.run([sys.executable, "-m", "fedmech_flwr.tools.cli", *command.split()[1:]], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert shows(found[i][1], done.stdout), f"the page shows:\n{found[i][1]}--- the run printed ---\n{done.stdout}"


def test_a_failed_run_is_reported_as_failed(tmp_path):
    # the clients' weights overflow in round 1: a failure only the run itself can find
    done = fedmech_run(tmp_path, "train.lr=1e30")
    assert done.returncode == 1, done.stdout[-4000:]
    (run_dir,) = list(tmp_path.iterdir())
    last = done.stderr.strip().splitlines()[-1]  # the server's error reached the user, in one line
    assert re.match(r"failed: ClientFailure: round 1: client \d failed \(non-finite weights in ", last) and "--resume" in last
    assert read_status(run_dir)["status"] == "failed"
    page = run_dir / "report" / "index.html"  # the page says so first
    assert last.endswith(f" | page: {page}")
    text = page.read_text()
    assert f"<h1>fedmech run {run_dir.name}: failed</h1>" in text
    assert text.index("Runs not in the statistics") < text.index("Protocol") and "non-finite weights" in text


def test_bad_input_is_refused_before_flower_starts(tmp_path):
    done = fedmech_run(tmp_path, "data.dataset={name: fashion_mnist, root: /nonexistent/fmnist}")
    assert done.returncode == 2, done.stdout[-4000:] + done.stderr[-4000:]
    assert done.stderr.startswith("error: dataset 'fashion_mnist'") and "data.dataset" in done.stderr.splitlines()[0]
    assert "/nonexistent/fmnist" in done.stderr  # where it looked
    assert "finished:" not in done.stdout  # flwr run never started
    assert not list(tmp_path.iterdir()), "a run refused on bad input must leave no run folder"


def test_sigkill_mid_run_then_resume_ends_as_the_uninterrupted_run(completed, tmp_path):
    """SIGKILL of the CLI alone: within 10 s nothing of its run is alive (the launch's
    reaper), and ``--resume`` ends bitwise as the uninterrupted run."""
    reference, _ = completed
    proc = subprocess.Popen(fedmech_command(tmp_path), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    after_round_1(proc, tmp_path)
    assert proc.poll() is None, "the run ended before it could be killed"
    # Freeze the ServerApp (the run folder's writer) so that the kill lands after round 1
    # however slowly this host finds the launch's processes; the reaper's SIGKILL ends a
    # stopped process as any other.
    (run_dir,) = list(tmp_path.iterdir())
    os.kill(read_status(run_dir)["pid"], signal.SIGSTOP)
    started = launch_processes_of(proc.pid)
    assert started, "no process of the run's launch was found"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert_gone(started, 10, "processes of the killed run are still alive")
    assert read_status(run_dir)["status"] == "running"  # as a kill leaves it
    assert not (run_dir / "model_final.safetensors").exists()
    killed_after = int(load_arrays(run_dir / STATE_FILE)["round"])
    assert killed_after in (1, 2)

    resumed = subprocess.run([sys.executable, "-m", "fedmech_flwr.tools.cli", "run", "--resume", str(run_dir)],
                             cwd=REPO, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-4000:] + resumed.stderr[-4000:]
    assert f"Resuming {run_dir} after round {killed_after}" in resumed.stdout
    assert_same_run(reference, run_dir)
    assert lost_bytes(reference, run_dir) == 0


PAGE_ON_A_FULL_DISK = """
import sys
from pathlib import Path
sys.path.insert(0, "tests")
from faults import fill
import fedmech_flwr.tools.finish as finish
from fedmech_flwr.tools.cli import main
write_page, ballast = finish.write_page, Path(sys.argv[1]) / "ballast"
def full_then_write_page(*args, **kwargs):
    if not ballast.exists():
        fill(ballast.parent)
    return write_page(*args, **kwargs)
finish.write_page = full_then_write_page
sys.exit(main(sys.argv[2:]))
"""


def test_sighup_then_a_full_disk_at_the_page_then_resume_ends_as_the_uninterrupted_run(completed, disk):
    """SIGHUP (a closed terminal) is handled as Ctrl-C: the ``--resume`` line, exit 129, status
    interrupted. The resumed run then meets a full disk when the CLI writes its page, the
    last output: one line, exit 1, status failed and resumable, the rounds all done. Once
    space is free, ``--resume`` finishes without running a round and ends as the
    uninterrupted run."""
    reference, _ = completed
    proc = subprocess.Popen(fedmech_command(disk / "out"), cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    after_round_1(proc, disk / "out")
    proc.send_signal(signal.SIGHUP)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGHUP, stderr[-4000:]
    (run_dir,) = list((disk / "out").iterdir())
    assert stderr.strip().splitlines()[-1].startswith(
        f"stopped: every process the run started is stopped; continue it with `fedmech run --resume {run_dir}`")
    status = read_status(run_dir)
    assert (status["status"], status["error"], status["resumable"]) == ("interrupted", "stopped by SIGHUP", True)

    resumed = subprocess.run([sys.executable, "-c", PAGE_ON_A_FULL_DISK, str(disk), "run", "--resume", str(run_dir)],
                             cwd=REPO, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 1, resumed.stdout[-4000:] + resumed.stderr[-4000:]
    last = resumed.stderr.strip().splitlines()[-1]
    assert last.startswith("failed: after the last round, could not write the run's page (") and \
        "No space left on device" in last and f"continue it: fedmech run --resume {run_dir}" in last, last
    assert "Traceback" not in resumed.stderr
    status = read_status(run_dir)
    assert status["status"] == "failed" and status["resumable"] is True
    assert int(load_arrays(run_dir / STATE_FILE)["round"]) == 3

    (disk / "ballast").unlink()
    finished = subprocess.run([sys.executable, "-m", "fedmech_flwr.tools.cli", "run", "--resume", str(run_dir)],
                              cwd=REPO, capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stdout[-4000:] + finished.stderr[-4000:]
    assert f"Resuming {run_dir} after round 3" in finished.stdout
    assert not re.search(r"^round \d", finished.stdout, re.MULTILINE)  # no round ran again
    assert_same_run(reference, run_dir)
    assert (run_dir / "report" / "index.html").is_file()


def test_a_private_ray_that_dies_mid_run_fails_the_run_instead_of_hanging(tmp_path):
    """The private Ray head exits during a round (seen when another program took one of
    its ports): Flower would wait for it forever; the launch is stopped, the run fails
    with one line naming Ray, resumable, and nothing of the launch is left running."""
    proc = subprocess.Popen(fedmech_command(tmp_path / "out", "federation.num_rounds=50"), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    after_round_1(proc, tmp_path / "out")
    launched = launch_processes_of(proc.pid)
    (head,) = [pid for pid in launched if {b"start", b"--head"} <= set(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"))]
    os.kill(head, signal.SIGKILL)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1, stderr[-4000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("failed: ") and "the private Ray head exited during the run (code -9" in last, last
    (run_dir,) = list((tmp_path / "out").iterdir())
    assert f"fedmech run --resume {run_dir}" in last
    assert read_status(run_dir)["status"] in ("failed", "interrupted")
    assert not [pid for pid in launched if process_alive(pid)]

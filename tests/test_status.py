"""``fedmech status``: a real smoke run folder and hand-written ones (running, interrupted,
failed, on another host, a sweep) against known answers: state, round k of N, ETA,
headline flags, sweep counts and ETA, exit codes, bad input."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
from pathlib import Path

import yaml

from fedmech_flwr.foundation.safe_text import CONTROL, printable
from fedmech_flwr.tools import cli
from fedmech_flwr.tools.cli import main
from fedmech_flwr.tools.status import read_sweep, run_status, seconds_per_round, sweep_status

HOST = socket.gethostname()


def dead_pid() -> int:
    gone = subprocess.Popen(["true"])
    gone.wait()
    return gone.pid


def write_run(path: Path, status: str = "running", evals: tuple | None = None,
              num_rounds: int = 5, pid: int | None = None, host: str = HOST, one_class: bool = False,
              **extra) -> Path:
    """A run folder as a run writes it: eval records of ``(round, elapsed_seconds)``, by
    default 10 s a round up to round 3, or up to the last round of a completed run."""
    last = num_rounds if status == "completed" else 3
    evals = evals if evals is not None else tuple((r, 10.0 * r) for r in range(last + 1))
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(yaml.safe_dump({"name": "t", "federation": {"num_rounds": num_rounds}}))
    (path / "status.json").write_text(json.dumps({"status": status, "pid": pid or os.getpid(), "host": host, **extra}))
    lines = [{"kind": "eval", "round": r, "accuracy": 0.4, "max_predicted_fraction": 1.0 if one_class else 0.3,
              "elapsed_seconds": t} for r, t in evals]
    (path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_a_completed_run_and_its_copy_on_another_host(smoke_run, tmp_path, capsys):
    text = run_status(smoke_run)
    assert text.splitlines()[0] == f"run {smoke_run.name}: completed"
    assert "round 2 of 2" in text and "round 2: global test accuracy" in text and "--resume" not in text
    copy = Path(shutil.copytree(smoke_run, tmp_path / "copy"))
    (copy / "status.json").write_text(json.dumps({"status": "running", "pid": 7, "host": "gpu-7"}))
    text = run_status(copy)
    assert "running on gpu-7 (pid 7), not checked from here" in text and "round 2 of 2, ETA 0s" in text
    assert main(["status", str(copy)]) == 0
    assert main(["status", str(smoke_run)]) == 0


def test_a_running_run_shows_its_eta_and_a_one_class_flag(tmp_path, capsys):
    run = write_run(tmp_path / "run", one_class=True)
    assert main(["status", str(run)]) == 0
    out = capsys.readouterr().out
    assert f"run run: running (pid {os.getpid()} on {HOST})" in out
    assert "round 3 of 5, ETA 20s" in out  # 10 s per round, 2 rounds left
    assert "round 3: global test accuracy 40.0% ⚑ one class" in out


def test_pace_is_taken_since_the_last_restart_of_the_clock():
    evals = lambda *timed: [{"round": r, "elapsed_seconds": t} for r, t in timed]  # noqa: E731
    assert seconds_per_round(evals((0, 0.0), (1, 10.0), (2, 20.0), (3, 30.0))) == 10.0
    assert seconds_per_round(evals((0, 0.0), (1, 10.0), (2, 20.0), (3, 15.0), (4, 27.0))) == 12.0  # resumed at 3
    assert seconds_per_round(evals((0, 0.0), (1, 10.0), (2, 4.0))) is None  # no round finished since the resume
    assert seconds_per_round(evals((0, 5.0))) is None
    assert seconds_per_round([{"round": 0}, {"round": 1}]) is None  # an older folder


def test_an_unknown_pace_says_eta_unknown(tmp_path):
    assert "round 0 of 5, ETA unknown" in run_status(write_run(tmp_path / "a", evals=((0, 3.0),)))
    assert "round - of 5, ETA unknown" in run_status(write_run(tmp_path / "b", evals=()))


def test_interrupted_and_failed_runs_exit_1_with_how_to_continue(tmp_path, capsys):
    gone = write_run(tmp_path / "gone", pid=dead_pid())
    failed = write_run(tmp_path / "failed", status="failed", error="round 2: test loss is nan (diverged)")
    final = write_run(tmp_path / "final", status="failed", error="bad plug-in", resumable=False)
    for run in (gone, failed, final):
        assert main(["status", str(run)]) == 1
    out = capsys.readouterr().out
    assert "run gone: interrupted: status.json says running, but its process" in out
    assert f"continue it: fedmech run --resume {gone.resolve()}" in out
    assert "run failed: failed: round 2: test loss is nan (diverged)" in out
    assert f"continue it: fedmech run --resume {failed.resolve()}" in out
    assert "run final: failed: bad plug-in" in out and f"--resume {final.resolve()}" not in out
    assert "round 3 of 5\n" in out  # no ETA for a stopped run


def test_a_reused_pid_an_interruption_and_a_run_that_never_started(tmp_path, capsys):
    """A status naming this process's pid with another start time was written by another
    process that has gone (its pid reused): interrupted. A status of ``interrupted`` (a
    signal stopped it) says how to continue. A folder holding only the lock of a gone
    ``fedmech`` process is a run that never started."""
    from fedmech_flwr.artifacts.liveness import process_start

    reused = write_run(tmp_path / "reused", start=process_start(os.getpid()) - 1)
    assert main(["status", str(reused)]) == 1
    assert "run reused: interrupted: status.json says running, but its process" in capsys.readouterr().out
    assert main(["status", str(write_run(tmp_path / "live", start=process_start(os.getpid())))]) == 0
    capsys.readouterr()

    stopped = write_run(tmp_path / "stopped", status="interrupted", error="stopped by SIGTERM", resumable=True)
    assert main(["status", str(stopped)]) == 1
    out = capsys.readouterr().out
    assert "run stopped: interrupted: stopped by SIGTERM" in out and f"--resume {stopped.resolve()}" in out

    lonely = tmp_path / "lonely"
    lonely.mkdir()
    (lonely / "run.lock").write_text(json.dumps({"pid": dead_pid(), "host": HOST, "since": "2026-12-06T00:00:00"}))
    assert main(["status", str(lonely)]) == 1
    out = capsys.readouterr().out
    assert out.startswith("run lonely: never started: the fedmech process that made it ended before the run began")
    assert "--resume" not in out


def test_names_and_reasons_read_from_files_show_escaped_one_line_each(tmp_path, capsys):
    """A folder named ``ESC ] 0;x BEL`` + newline retitles no terminal and forges no line;
    nor does a run's error or a sweep's cell name."""
    planted = "a\x1b]0;x\x07\nb"
    run = write_run(tmp_path / planted, status="failed", error="boom\x1b[2J\nrun other: completed\u202e")
    assert main(["status", str(run)]) == 1
    out = capsys.readouterr().out
    assert out.splitlines() == [
        "run a\\x1b]0;x\\x07\\nb: failed: boom\\x1b[2J\\nrun other: completed\\u202e",
        "  round 3 of 5",
        "  round 3: global test accuracy 40.0%",
        f"  continue it: fedmech run --resume {printable(str(run.resolve()))}"]
    sweep = tmp_path / "sweep"
    write_run(sweep / "runs" / "c", status="failed", error="x")
    (sweep / "sweep.json").write_text(json.dumps({"name": f"g{planted}", "cells": [
        {"name": planted, "run_dir": "runs/c", "status": "failed", "error": "line one\nline two\x07"}]}))
    assert main(["status", str(sweep)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "sweep ga\\x1b]0;x\\x07\\nb: failed" and len(lines) == 4
    assert lines[2] == "  a\\x1b]0;x\\x07\\nb: failed: x (sweep: line one\\nline two\\x07)"
    assert not any(CONTROL.search(line) for line in lines)


def test_a_torn_last_line_is_skipped(tmp_path):
    run = write_run(tmp_path / "run")
    with open(run / "metrics.jsonl", "a") as fh:
        fh.write('{"kind": "eval", "round": 4, "accu')
    assert "round 3 of 5, ETA 20s" in run_status(run)


def test_bad_input_exits_2_in_one_line(tmp_path, capsys):
    assert main(["status", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "is neither a run folder (status.json, config.yaml and metrics.jsonl" in err and "sweep.json" in err
    assert len(err.strip().splitlines()) == 1
    assert main(["status", str(tmp_path / "gone")]) == 2
    assert f"{tmp_path / 'gone'} does not exist" in capsys.readouterr().err
    run = write_run(tmp_path / "run")
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join([lines[0], "garbage", *lines[1:]]) + "\n")
    assert main(["status", str(run)]) == 2
    assert f"{run / 'metrics.jsonl'}, line 2" in capsys.readouterr().err
    (run / "status.json").write_text('{"status": "runn')
    assert main(["status", str(run)]) == 2
    assert f"{run / 'status.json'} is not JSON" in capsys.readouterr().err


def make_sweep(root: Path, alive: bool) -> Path:
    """Cells: 3 completed (60, 80, 100 s; one the manifest left "running"), one failed,
    one running (round 2 of 4 at 10 s a round; ``alive``: by this process, as the sweep),
    one interrupted, two pending."""
    cells, pid = [], os.getpid() if alive else dead_pid()

    def cell(name: str, status: str, seconds: float = 0.0, error: str | None = None) -> None:
        cells.append({"name": name, "run_dir": f"runs/{name}", "status": status, "error": error, "seconds": seconds,
                      "config": {"federation": {"num_rounds": 4}}})

    for i, seconds in enumerate((60.0, 80.0, 100.0)):
        write_run(root / "runs" / f"done_s{i}", status="completed", num_rounds=4)
        cell(f"done_s{i}", "running" if i == 2 else "completed", seconds)
    write_run(root / "runs" / "bad_s0", status="failed", num_rounds=4, error="round 1: test loss is nan")
    cell("bad_s0", "failed", 12.0, "round 1: test loss is nan (log: logs/bad_s0.log)")
    write_run(root / "runs" / "live_s0", evals=((0, 0.0), (1, 10.0), (2, 20.0)), num_rounds=4, pid=pid)
    cell("live_s0", "running")
    write_run(root / "runs" / "killed_s0", pid=dead_pid(), num_rounds=4)
    cell("killed_s0", "interrupted")
    cell("todo_s0", "pending")
    cell("todo_s1", "pending")
    (root / "sweep.json").write_text(json.dumps({"name": "grid", "cells": cells}))
    (root / "sweep.lock").write_text(json.dumps({"pid": pid, "host": HOST}))
    return root


def test_a_running_sweep_counts_its_cells_and_its_eta(tmp_path, capsys):
    sweep = read_sweep(make_sweep(tmp_path, alive=True))
    assert sweep.state == "running" and sweep.median == 80.0
    assert {s: sweep.count(s) for s in ("completed", "failed", "running", "interrupted", "pending")} == \
        {"completed": 3, "failed": 1, "running": 1, "interrupted": 1, "pending": 2}
    assert sweep.eta == 3 * 80.0 + 20.0  # 3 cells left, one at a time, after the running cell's 20 s
    text = sweep_status(tmp_path)
    assert f"sweep grid: running (pid {os.getpid()} on {HOST})" in text
    assert "8 cells: 3 completed, 1 failed, 1 running, 1 interrupted, 2 pending; ETA 4m20s" in text
    assert f"live_s0: running (pid {os.getpid()} on {HOST}), round 2 of 4, ETA 20s" in text
    assert "bad_s0: failed: round 1: test loss is nan (log: logs/bad_s0.log)" in text
    assert main(["status", str(tmp_path)]) == 1  # running, but with a failed and an interrupted cell


def test_a_stopped_sweep_says_how_to_continue_and_a_completed_one_exits_0(tmp_path, capsys):
    stopped = make_sweep(tmp_path / "stopped", alive=False)
    assert main(["status", str(stopped)]) == 1
    out = capsys.readouterr().out
    assert "sweep grid: interrupted (no `fedmech sweep` runs it)" in out and "ETA" not in out.splitlines()[1]
    assert f"run the same `fedmech sweep` command again (sweep folder {stopped.resolve()}; --retry-failed" in out
    done = tmp_path / "done"
    write_run(done / "runs" / "a_s0", status="completed")
    (done / "sweep.json").write_text(json.dumps({"name": "g", "cells": [
        {"name": "a_s0", "run_dir": "runs/a_s0", "status": "completed", "seconds": 5.0}]}))
    assert main(["status", str(done)]) == 0
    assert "sweep g: completed\n  1 cells: 1 completed, 0 failed" in capsys.readouterr().out


def test_watch_redraws_until_the_run_ends_and_ctrl_c_exits_0(tmp_path, capsys, monkeypatch):
    run = write_run(tmp_path / "run", num_rounds=3)

    def finish(seconds: float) -> None:
        assert seconds == 0.5
        (run / "status.json").write_text(json.dumps({"status": "completed"}))

    monkeypatch.setattr(cli.time, "sleep", finish)
    assert main(["status", str(run), "--watch", "--interval", "0.5"]) == 0
    out = capsys.readouterr().out
    assert out.count("(every 0.5s; Ctrl-C stops)") == 2 and "\x1b[" not in out  # not a TTY: one block each
    assert out.index("run run: running") < out.index("run run: completed")

    def interrupt(seconds: float) -> None:
        raise KeyboardInterrupt

    (run / "status.json").write_text(json.dumps({"status": "running", "pid": os.getpid(), "host": HOST}))
    monkeypatch.setattr(cli.time, "sleep", interrupt)
    assert main(["status", str(run), "--watch"]) == 0

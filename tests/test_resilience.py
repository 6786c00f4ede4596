"""Long runs that survive: client faults, divergence, kill-and-resume, atomic and safe files.

Faults are injected with ``tests/faults.py`` into tiny in-process runs of the smoke
config; each test asserts what was kept, what was dropped and what was reported. The
real ``flwr run`` + SIGKILL case is in ``test_flwr_run.py``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import socket
import subprocess
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Error
from flwr.common.constant import ErrorCode

from conftest import REPO, SMOKE, as_killed, assert_same_run, killed_then_resumed, run_folders, smoke_config
from faults import INJECTED, Fault, SimulatedCrash, faulty_app
from fedmech_flwr.app.inprocess import resume_in_process, run_in_process
from fedmech_flwr.app.protocol import ClientFailure, failure_reason
from fedmech_flwr.app.protocol import REASON_MAX_CHARS, one_line
from fedmech_flwr.app.run import Diverged
from fedmech_flwr.artifacts.folder import LOCK_FILE, METRICS_FILE, STATE_FILE, RunFolder, read_records, read_status
from fedmech_flwr.builtin.strategies.fedavg import WeightedFedAvg
from fedmech_flwr.contracts import plugins
from fedmech_flwr.contracts.strategy import OFFERED_NODES_ONLY, STRATEGIES
from fedmech_flwr.foundation.errors import BadFileError, RunFolderError
from fedmech_flwr.foundation.files import TEMPORARY_GLOB, write_atomic
from fedmech_flwr.learning.arrays import NamedArrays, from_record, load_arrays, non_finite, save_arrays, to_record
from fedmech_flwr.tools import cli
from fedmech_flwr.tools.cli import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, main
from fedmech_flwr.tools.local_flower import LaunchResult

ROUNDS = 3
LONG = ["federation.num_rounds=3", "federation.checkpoint_every=2"]
"""Three rounds, numbered checkpoints after rounds 2 and 3 (the last), a resume point every round."""
CONTINUE = "federation.on_client_failure=continue"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """An uninterrupted three-round run to compare resumed runs with."""
    return run_in_process(smoke_config(LONG), tmp_path_factory.mktemp("reference"))


# --- client faults ----------------------------------------------------------------------

def test_nan_weights_are_dropped_before_aggregation_and_recorded(tmp_path):
    run = run_in_process(smoke_config([CONTINUE]), tmp_path, faulty_app(Fault("nan", 1, 2)))
    assert read_status(run)["status"] == "completed"
    [failure] = read_records(run, "failure")
    assert failure == {"kind": "failure", "round": 2, "partition_id": 1, "policy": "continue",
                       "reason": "non-finite weights in conv1.weight"}
    assert sorted((r["round"], r["partition_id"]) for r in read_records(run, "client")) == [
        (1, 0), (1, 1), (1, 2), (2, 0), (2, 2)]
    assert read_records(run, "eval")[2]["clients_succeeded"] == [0, 2]
    for path in [*run.glob("checkpoints/*.safetensors"), run / "model_final.safetensors", run / STATE_FILE]:
        assert non_finite(load_arrays(path)) == [], path
    assert all(math.isfinite(r["loss"]) for r in read_records(run, "eval"))


def test_inf_weights_with_fail_policy_stop_the_run(tmp_path):
    with pytest.raises(ClientFailure, match=r"round 2: client 1 failed \(non-finite weights in conv1.weight\)"):
        run_in_process(smoke_config(), tmp_path, faulty_app(Fault("inf", 1, 2)))
    [run] = run_folders(tmp_path)
    assert read_status(run)["status"] == "failed" and "non-finite weights" in read_status(run)["error"]
    assert [(f["round"], f["partition_id"], f["policy"]) for f in read_records(run, "failure")] == [(2, 1, "fail")]
    assert load_arrays(run / STATE_FILE)["round"] == 1  # round 1 stays the resume point


def test_hanging_client_is_dropped_after_the_round_timeout(tmp_path):
    cfg = smoke_config([CONTINUE, "federation.round_timeout_s=3"])
    run = run_in_process(cfg, tmp_path, faulty_app(Fault("hang", 2, 2)))
    assert read_status(run)["status"] == "completed"
    [failure] = read_records(run, "failure")
    assert (failure["round"], failure["partition_id"], failure["reason"]) == (2, 2, "timeout: no reply within 3s")
    assert read_records(run, "eval")[2]["clients_succeeded"] == [0, 1]
    assert [r["partition_id"] for r in read_records(run, "client") if r["round"] == 2] == [0, 1]


SITE = sysconfig.get_paths()["purelib"]
"""This interpreter's site-packages: a library's frames, which no failure is put down to."""
RAY_REASON = (
    "<class 'ray.exceptions.RayTaskError(ClientAppException)'>:<'\x1b[36mray::ClientAppActor.run()\x1b[39m "
    "(pid=81433, ip=10.0.0.5, actor_id=6d4f0c1e2b8a7f5e3c9d01a4000000, repr=<flwr.simulation.ray_transport."
    "ray_actor.ClientAppActor object at 0x7f3a5c2e1d90>)\n"
    f'  File "{SITE}/flwr/simulation/ray_transport/ray_actor.py", '
    "line 60, in run\n    out_message = app(message=message, context=context)\n"
    f'  File "{SITE}/flwr/clientapp/client_app.py", line 174, in __call__\n'
    "    return self._call(message, context)\n"
    f'  File "{REPO}/fedmech_flwr/app/client_app.py", line 131, in train\n'
    "    new_params, num_examples, client_metrics = client.fit(params, {**fit_config})\n"
    f'  File "{REPO}/clients/plain.py", line 40, in fit\n    raise RuntimeError("CUDA out of memory")\n'
    "RuntimeError: CUDA out of memory\n\nThe above exception was the direct cause of the following exception:\n\n"
    "\x1b[36mray::ClientAppActor.run()\x1b[39m (pid=81433, ip=10.0.0.5, actor_id=6d4f0c1e2b8a7f5e3c9d01a4000000)\n"
    f'  File "{SITE}/flwr/simulation/ray_transport/ray_actor.py", '
    "line 65, in run\n    raise ClientAppException(str(ex)) from ex\n"
    "flwr.clientapp.client_app.ClientAppException: \nException ClientAppException occurred. "
    "Message: CUDA out of memory'>"
)
"""What Flower's Ray simulation puts in the error reply of a ClientApp that raised (the
shape of a real one: ``str(type(e)) + ":<'" + str(e) + "'>"`` of Ray's wrapper)."""


@pytest.mark.parametrize(("text", "line"), [
    (RAY_REASON, "RuntimeError: CUDA out of memory"),
    ("<class 'ZeroDivisionError'>:<'division by zero'>", "ZeroDivisionError: division by zero"),
    ("RuntimeError: injected crash", "RuntimeError: injected crash"),
    ("\x1b[31mnode gone\x1b[0m\n", "node gone"),
    ("ValueError: " + "x" * 300, "ValueError: " + "x" * 185 + "..."),
], ids=["ray traceback", "flower wrapper", "one line", "colours", "too long"])
def test_a_client_error_becomes_one_line(text, line):
    assert one_line(text) == line
    assert len(one_line(text)) <= REASON_MAX_CHARS


def test_a_failed_client_is_recorded_in_one_line_with_its_traceback_in_logs(tmp_path):
    plugins.load()  # as on the server: the plug-in's frame is named by the module it was imported as
    folder = RunFolder(tmp_path)
    for server_round in (1, 2):
        error = Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=RAY_REASON)
        folder.failure(server_round, 1, failure_reason(error), "continue", error.reason)
    records = read_records(tmp_path, "failure")
    assert records[1] == {"kind": "failure", "round": 2, "partition_id": 1, "policy": "continue",
                          "reason": f"raised: RuntimeError: CUDA out of memory (in fedmech_flwr.builtin.clients.plain "
                                    f"({REPO}/clients/plain.py:40))",  # the plug-in's frame
                          "details": "logs/client_failures.log"}
    log_text = (tmp_path / "logs" / "client_failures.log").read_text()
    assert "\x1b" not in log_text
    assert log_text.count("raise ClientAppException(str(ex)) from ex") == 2  # appended, whole
    assert re.match(r"--- round 1, client 1, \S+: raised: RuntimeError: CUDA out of memory "
                    r"\(in fedmech_flwr\.builtin\.clients\.plain .*\)\n<class 'ray", log_text)


# --- divergence -------------------------------------------------------------------------

def test_divergence_stops_the_run_and_keeps_the_last_good_state(tmp_path):
    with pytest.raises(Diverged, match=r"round 2: the global model diverged \(test loss (nan|inf)\)") as info:
        run_in_process(smoke_config(), tmp_path, faulty_app(Fault("explode", 0, 2)))
    assert "last good model is round 1's" in str(info.value)
    [run] = run_folders(tmp_path)
    status = read_status(run)
    assert status["status"] == "failed" and "Diverged: round 2" in status["error"]
    evals = read_records(run, "eval")
    assert [r["round"] for r in evals] == [0, 1, 2] and not math.isfinite(evals[2]["loss"])  # reported
    state = load_arrays(run / STATE_FILE)
    assert state["round"] == 1  # kept: round 1's state, not overwritten by round 2's
    round_1 = load_arrays(run / "checkpoints" / "round_001.safetensors")
    assert all(state[f"model/{k}"].tobytes() == v.tobytes() for k, v in round_1.items())
    assert not (run / "checkpoints" / "round_002.safetensors").exists()  # dropped
    assert not (run / "model_final.safetensors").exists()


# --- kill and resume --------------------------------------------------------------------

@dataclass(frozen=True)
class CrashPoint:
    """Where a simulated kill lands: in a client's training, or just before a RunFolder write."""

    name: str
    method: str | None
    round: int
    partial_records: int
    """Records the killed round had written (3 clients, 1 diagnostic, its eval)."""
    torn_line: bool = False


CRASH_POINTS = [
    CrashPoint("in client 2's training in round 2", None, 2, 0),
    CrashPoint("after round 2's client and strategy records, before its eval", "eval", 2, 4, torn_line=True),
    CrashPoint("after round 2's eval and diagnostic files, before its checkpoint and commit", "checkpoint", 2, 6),
    CrashPoint("before round 0 was committed", "eval", 0, 0),
]


def crash_before(monkeypatch, method: str, at_round: int) -> None:
    original = getattr(RunFolder, method)

    def crashing(self, server_round, *args):
        if server_round == at_round:
            INJECTED["crash"] += 1
            raise SimulatedCrash(f"killed before RunFolder.{method} of round {at_round}")
        return original(self, server_round, *args)

    monkeypatch.setattr(RunFolder, method, crashing)


@pytest.mark.parametrize("point", CRASH_POINTS, ids=lambda p: p.name)
def test_killed_run_resumes_to_the_same_records_and_weights(point, reference, tmp_path, monkeypatch):
    app = faulty_app(Fault("crash", 2, point.round)) if point.method is None else None
    with monkeypatch.context() as patch:
        if point.method:
            crash_before(patch, point.method, point.round)
        with pytest.raises(SimulatedCrash):
            run_in_process(smoke_config(LONG), tmp_path, app)
    [run] = run_folders(tmp_path)
    as_killed(run)
    (run / ".tmpNwx9vq").write_bytes(b"\0" * 64)  # as safetensors leaves a kill mid-save
    if point.torn_line:
        with open(run / "metrics.jsonl", "a") as fh:
            fh.write('{"kind": "client", "round": 2, "partition_id": 0, "train-lo')
    assert not (run / "model_final.safetensors").exists()
    records = read_records(run) if (run / "metrics.jsonl").exists() else []
    assert len([r for r in records if r["round"] == point.round]) == point.partial_records
    committed = point.round - 1 if point.round else None
    assert (load_arrays(run / STATE_FILE)["round"] if (run / STATE_FILE).exists() else None) == committed

    assert resume_in_process(run) == run
    assert_same_run(reference, run)
    assert not list(run.rglob(TEMPORARY_GLOB))


def test_resume_of_a_run_killed_after_its_last_round_only_finishes_it(reference, tmp_path):
    run = Path(shutil.copytree(reference, tmp_path / "run"))
    (run / "model_final.safetensors").unlink()
    as_killed(run)
    assert resume_in_process(run) == run
    assert_same_run(reference, run)


def test_a_completed_run_with_its_last_records_torn_says_so_everywhere_and_resumes_them(reference, tmp_path,
                                                                                          capsys):
    """A completed run whose metrics.jsonl lost its last line (round 3's diagnostic record,
    torn): status, export and report say "completed, but records end at round 2 of 3" and
    never present round 2 as the final result; ``--resume`` reruns round 3 from the
    checkpoint of round 2, and the run ends as the uninterrupted one."""
    run = Path(shutil.copytree(reference, tmp_path / "run"))
    lines = (run / METRICS_FILE).read_text().splitlines(keepends=True)
    assert json.loads(lines[-1])["kind"] == "diagnostic"
    (run / METRICS_FILE).write_text("".join(lines[:-1]) + lines[-1][:25])
    said = f"completed, but records end at round 2 of {ROUNDS}"
    assert main(["status", str(run)]) == EXIT_FAILED and said in capsys.readouterr().out
    assert main(["export", str(run), "--out", str(tmp_path / "runs.csv")]) == EXIT_OK
    assert said in capsys.readouterr().err
    assert main(["report", str(run), "--out", str(tmp_path / "report")]) == EXIT_OK
    assert said in (tmp_path / "report" / "index.html").read_text()
    assert resume_in_process(run) == run
    assert_same_run(reference, run)
    assert main(["status", str(run)]) == EXIT_OK and said not in capsys.readouterr().out


def test_a_resumed_run_whose_last_committed_rounds_records_were_lost_runs_that_round_again(reference, tmp_path):
    """Killed in round 3 after committing round 2, with round 2's records lost: the resume
    does not continue after round 2 (that would complete without them) but from the
    latest checkpoint the records reach (none here: from the start)."""
    with pytest.raises(SimulatedCrash):
        run_in_process(smoke_config(LONG), tmp_path, faulty_app(Fault("crash", 2, 3)))
    [run] = run_folders(tmp_path)
    as_killed(run)
    assert load_arrays(run / STATE_FILE)["round"] == 2
    kept = [r for r in read_records(run) if r["round"] != 2 or r["kind"] not in ("eval", "diagnostic")]
    (run / METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in kept))
    assert resume_in_process(run) == run
    assert_same_run(reference, run)


class ServerMomentum(WeightedFedAvg):
    """FedAvg with server momentum (FedAvgM, Hsu et al. 2019): state across rounds,
    saved and restored through the ``Resumable`` hook."""

    def __init__(self, beta: float) -> None:
        super().__init__(**OFFERED_NODES_ONLY)
        self.beta = beta
        self.velocity: NamedArrays = {}
        self.sent: NamedArrays = {}

    def configure_train(self, server_round, arrays: ArrayRecord, config: ConfigRecord, grid):
        self.sent = from_record(arrays)
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round, replies):
        arrays, metrics = super().aggregate_train(server_round, replies)
        mean = from_record(arrays)
        for k, v in mean.items():
            if v.dtype == np.float32:
                self.velocity[k] = self.beta * self.velocity.get(k, 0.0) + (self.sent[k] - v)
                mean[k] = (self.sent[k] - self.velocity[k]).astype(np.float32)
        return to_record(mean), metrics

    def state_arrays(self) -> NamedArrays:
        return dict(self.velocity)

    def load_state_arrays(self, arrays: NamedArrays) -> None:
        self.velocity = dict(arrays)


@dataclass
class MomentumConfig:
    beta: float = 0.5


STRATEGIES.register("test_server_momentum", MomentumConfig)(lambda params, ctx: ServerMomentum(params.beta))


def test_strategy_state_survives_a_resume(tmp_path):
    state = killed_then_resumed(LONG + ["strategy={name: test_server_momentum, beta: 0.5}"], tmp_path, 1, 3)
    assert state["round"] == 2 and "strategy/conv1.weight" in state


# --- what resume refuses ----------------------------------------------------------------

def test_resume_refuses_what_it_cannot_continue(smoke_run, tmp_path):
    with pytest.raises(RunFolderError, match="is not a fedmech run folder \\(no config.yaml or status.json\\)"):
        resume_in_process(tmp_path)
    with pytest.raises(RunFolderError, match="holds a completed run: nothing to resume"):
        resume_in_process(smoke_run)
    run = Path(shutil.copytree(smoke_run, tmp_path / "live"))
    RunFolder(run).set_status("running")  # this very process is its writer
    with pytest.raises(RunFolderError, match="still being written by process"):
        resume_in_process(run)


def test_cli_resume_refuses_another_config(smoke_run, tmp_path, capsys):
    run = Path(shutil.copytree(smoke_run, tmp_path / "run"))
    as_killed(run)
    smoke = str(Path(__file__).parents[1] / "experiments" / "smoke.yaml")
    assert main(["run", "--resume", str(run), smoke, "--set", "federation.num_rounds=5"]) == EXIT_BAD_INPUT
    assert "changes federation.num_rounds; drop the experiment file and --set" in capsys.readouterr().err
    assert main(["run", "--resume", str(run), "--set", "seed=3"]) == EXIT_BAD_INPUT
    assert "--set cannot change a resumed run" in capsys.readouterr().err
    assert main(["run", "--resume", str(smoke_run)]) == EXIT_BAD_INPUT
    assert "completed run" in capsys.readouterr().err
    assert main(["run"]) == EXIT_BAD_INPUT
    assert "give an experiment file, or --resume RUN_DIR" in capsys.readouterr().err


# --- one process per run folder ----------------------------------------------------------

SINCE = "2025-01-02T03:04:05+00:00"


def lock(run: Path, pid: int, host: str | None = None) -> None:
    """Leave ``run.lock`` as a ``fedmech run`` of process ``pid`` holds it."""
    (run / LOCK_FILE).write_text(json.dumps({"pid": pid, "host": host or socket.gethostname(), "since": SINCE}))


def test_resume_of_a_folder_another_process_runs_exits_2_before_flower_starts(smoke_run, tmp_path, capsys,
                                                                                monkeypatch):
    run = Path(shutil.copytree(smoke_run, tmp_path / "run")).resolve()
    as_killed(run)
    monkeypatch.setattr(cli, "launch", lambda *_, **__: pytest.fail("Flower was started"))
    holder = subprocess.Popen(["sleep", "60"])
    try:
        lock(run, holder.pid)
        assert main(["run", "--resume", str(run)]) == EXIT_BAD_INPUT
        assert json.loads((run / LOCK_FILE).read_text())["pid"] == holder.pid  # the holder keeps its lock
    finally:
        holder.kill()
        holder.wait()
    assert capsys.readouterr().err == (
        f"error: {run} is being run by process {holder.pid} (since {SINCE}); wait for it or stop it, "
        f"then run `fedmech run --resume {run}` again if it did not complete\n")


@pytest.mark.parametrize("holder", ["dead process", "another host"])
def test_a_stale_lock_is_taken_over_and_held_while_the_run_runs(smoke_run, tmp_path, capsys, monkeypatch, holder):
    run = Path(shutil.copytree(smoke_run, tmp_path / "run")).resolve()
    as_killed(run)
    if holder == "dead process":
        gone = subprocess.Popen(["true"])
        gone.wait()
        lock(run, gone.pid)
    else:
        lock(run, os.getpid(), host="elsewhere")  # alive here, but another host's processes are not ours to see
    launched = []

    def launch(run_config, *_, **__):
        launched.append(run_config)
        assert json.loads((run / LOCK_FILE).read_text())["pid"] == os.getpid()
        assert main(["run", "--resume", str(run)]) == EXIT_BAD_INPUT  # a second resume meanwhile
        RunFolder(run).set_status("completed")
        return LaunchResult(1, "finished:completed")

    monkeypatch.setattr(cli, "launch", launch)
    assert main(["run", "--resume", str(run)]) == EXIT_OK
    assert launched == [{"resume": str(run)}]
    assert f"{run} is being run by process {os.getpid()} (since " in capsys.readouterr().err
    assert not (run / LOCK_FILE).exists()


@pytest.mark.parametrize("server_made_the_folder", [True, False])
def test_a_new_run_holds_its_folder_and_leaves_no_empty_one(tmp_path, monkeypatch, server_made_the_folder):
    def launch(run_config, *_, **__):
        run_dir = Path(run_config["run-dir"])
        assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == os.getpid()
        if not server_made_the_folder:  # e.g. the ServerApp refused the config
            return LaunchResult(1, "finished:failed")
        RunFolder.create(run_config["out"], "smoke", run_dir).set_status("completed")  # accepts the lock
        return LaunchResult(1, "finished:completed")

    monkeypatch.setattr(cli, "launch", launch)
    expected = EXIT_OK if server_made_the_folder else EXIT_FAILED
    assert main(["run", str(SMOKE), "--out", str(tmp_path)]) == expected
    runs = list(tmp_path.iterdir())
    assert len(runs) == int(server_made_the_folder)
    assert not any((r / LOCK_FILE).exists() for r in runs)


# --- Ctrl-C ---------------------------------------------------------------------------

@pytest.mark.parametrize("server_made_the_folder", [True, False])
def test_ctrl_c_stops_a_new_run_with_one_line_and_no_traceback(tmp_path, capsys, monkeypatch, server_made_the_folder):
    def interrupted(run_config, *_, **__):
        if server_made_the_folder:
            RunFolder.create(run_config["out"], "smoke", run_config["run-dir"])
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "launch", interrupted)
    assert main(["run", str(SMOKE), "--out", str(tmp_path)]) == EXIT_INTERRUPTED == 130
    runs = run_folders(tmp_path)
    [line] = capsys.readouterr().err.lstrip("\n").splitlines()
    if server_made_the_folder:
        [run] = runs
        page = run / "report" / "index.html"
        assert line == ("stopped: every process the run started is stopped; "
                        f"continue it with `fedmech run --resume {run}` | page: {page}")
        assert page.is_file()
    else:
        assert not runs and line.startswith(f"stopped before the run folder {tmp_path}/smoke-")
        assert line.endswith(" was made: nothing to resume; start the run again")


def test_ctrl_c_stops_a_resumed_run_with_how_to_resume_it_again(smoke_run, tmp_path, capsys, monkeypatch):
    run = killed_copy(smoke_run, tmp_path).resolve()
    monkeypatch.setattr(cli, "launch", lambda *_, **__: (_ for _ in ()).throw(KeyboardInterrupt))
    assert main(["run", "--resume", str(run)]) == EXIT_INTERRUPTED
    assert capsys.readouterr().err == (f"\nstopped: every process the run started is stopped; continue it with "
                                       f"`fedmech run --resume {run}` | page: {run / 'report' / 'index.html'}\n")
    assert not (run / LOCK_FILE).exists()


# --- damaged files ----------------------------------------------------------------------

def killed_copy(smoke_run: Path, tmp_path: Path) -> Path:
    run = Path(shutil.copytree(smoke_run, tmp_path / "run"))
    as_killed(run)
    return run


def test_truncated_resume_point_gives_a_clear_error(smoke_run, tmp_path):
    run = killed_copy(smoke_run, tmp_path)
    data = (run / STATE_FILE).read_bytes()
    (run / STATE_FILE).write_bytes(data[: len(data) // 2])
    with pytest.raises(BadFileError, match="state.safetensors is not a readable safetensors file") as info:
        resume_in_process(run)
    assert "truncated or foreign" in str(info.value)
    assert len(read_records(run, "eval")) == 3  # nothing was rewound


@pytest.mark.parametrize("damaged_checkpoints", [[], [2], [1, 2]], ids=["checkpoints intact", "last one damaged",
                                                                        "all damaged"])
def test_cli_resume_with_a_truncated_resume_point_exits_2_naming_a_way_on(smoke_run, tmp_path, capsys, monkeypatch,
                                                                           damaged_checkpoints):
    run = killed_copy(smoke_run, tmp_path).resolve()
    truncate(run / STATE_FILE)
    for server_round in damaged_checkpoints:
        truncate(run / "checkpoints" / f"round_{server_round:03d}.safetensors")
    monkeypatch.setattr(cli, "launch", lambda *_, **__: pytest.fail("Flower was started"))
    assert main(["run", "--resume", str(run)]) == EXIT_BAD_INPUT
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: {run / STATE_FILE} is not a readable resume point (")
    if damaged_checkpoints == [1, 2]:
        assert line.endswith(f"; no intact checkpoint to resume from: delete {run / STATE_FILE} "
                             "to restart this run from round 0")
    else:
        last = 1 if damaged_checkpoints else 2
        assert line.endswith(f"; resume from the checkpoint of round {last} (later rounds run again) with "
                             f"`fedmech run --resume {run} --from-checkpoint {last}`, or delete {run / STATE_FILE} "
                             "to restart from round 0")
    assert len(read_records(run, "eval")) == 3  # nothing was rewound
    assert not (run / LOCK_FILE).exists()


def test_resume_from_a_checkpoint_ends_as_an_uninterrupted_run(tmp_path, capsys, monkeypatch):
    """A stateful strategy (server momentum) too: its state after the checkpoint's round
    is saved beside the checkpoint. The run had finished round 3 (checkpoints 2 and 3) when
    its resume point was damaged; it resumes from round 2."""
    momentum = LONG + ["strategy={name: test_server_momentum, beta: 0.5}",
                       "diagnostics=[{name: weight_divergence, every: 2}]"]  # a diagnosed round is checkpointed too
    reference = run_in_process(smoke_config(momentum), tmp_path / "reference")
    run = Path(shutil.copytree(reference, tmp_path / "run")).resolve()
    (run / "model_final.safetensors").unlink()
    as_killed(run)
    truncate(run / STATE_FILE)
    monkeypatch.setattr(cli, "launch", lambda *_, **__: pytest.fail("Flower was started"))
    assert main(["run", "--resume", str(run), "--from-checkpoint", "1"]) == EXIT_BAD_INPUT
    assert capsys.readouterr().err == (
        f"error: {run / 'checkpoints'} holds no checkpoint of round 1 with its state "
        "(checkpoints/state/round_001.safetensors); it has rounds 2, 3: pick one of those\n")

    def launch(run_config, *_, **__):
        assert load_arrays(run / STATE_FILE)["round"] == 2
        resume_in_process(run_config["resume"])
        return LaunchResult(1, "finished:completed")

    monkeypatch.setattr(cli, "launch", launch)
    assert main(["run", "--resume", str(run), "--from-checkpoint", "2"]) == EXIT_OK
    assert_same_run(reference, run)


def test_from_checkpoint_needs_resume(capsys):
    assert main(["run", str(SMOKE), "--from-checkpoint", "2"]) == EXIT_BAD_INPUT
    assert "--from-checkpoint only applies with --resume RUN_DIR" in capsys.readouterr().err


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize(
    ("arrays", "message"),
    [({"x": np.zeros(2, np.float32)}, r"lacks arrays \['round'\]"),
     ({"round": np.asarray(1), "model/x": np.zeros(2, np.float32)}, "does not fit the model of .*config.yaml")],
    ids=["foreign", "another model"],
)
def test_foreign_resume_point_gives_a_clear_error(smoke_run, tmp_path, arrays, message):
    run = killed_copy(smoke_run, tmp_path)
    save_arrays(run / STATE_FILE, arrays)
    with pytest.raises(BadFileError, match=message):
        resume_in_process(run)
    assert len(read_records(run, "eval")) == 3  # nothing was rewound


def test_pickle_checkpoint_is_refused_by_usae_without_loading_it(smoke_run, tmp_path, capsys):
    run = Path(shutil.copytree(smoke_run, tmp_path / "run"))
    (run / "checkpoints" / "round_001.safetensors").write_bytes(b"\x80\x04\x95 a pickle, never unpickled" * 8)
    assert main(["usae", str(smoke_run), f"{run}@1", "--layer", "conv2", "--out", str(tmp_path / "u")]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "round_001.safetensors is not a readable safetensors file" in err and "Traceback" not in err


def test_torn_last_metrics_line_is_skipped_with_a_warning(smoke_run, tmp_path, caplog):
    run = Path(shutil.copytree(smoke_run, tmp_path / "run"))
    whole = read_records(run)
    with open(run / "metrics.jsonl", "a") as fh:
        fh.write('{"kind": "eval", "rou')
    with caplog.at_level(logging.WARNING):
        assert read_records(run) == whole
    assert "skipping the torn last line" in caplog.text


def test_damaged_metrics_line_before_the_end_is_an_error(smoke_run, tmp_path):
    run = Path(shutil.copytree(smoke_run, tmp_path / "run"))
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join([lines[0], "garbage", *lines[1:]]) + "\n")
    with pytest.raises(BadFileError, match="metrics.jsonl, line 2: expected one JSON record per line"):
        read_records(run)


@pytest.mark.parametrize("line", ["null", "[1, 2]", '"eval"', '{"kind": "eval"}', '{"round": 1}',
                                  '{"kind": "eval", "round": "1"}', '{"kind": 1, "round": 1}'])
def test_json_metrics_line_that_is_not_a_record_is_an_error(tmp_path, line):
    folder = RunFolder(tmp_path)
    folder.eval(0, {"accuracy": 0.1})
    folder.eval(1, {"accuracy": 0.2})
    with open(tmp_path / "metrics.jsonl", "a") as fh:
        fh.write(line + "\n")
    before = (tmp_path / "metrics.jsonl").read_text()
    message = re.escape(f"{tmp_path / 'metrics.jsonl'}, line 3: expected a record (a JSON object with a string "
                        f"'kind' and an integer 'round'), got {line!r}; the file was damaged")
    with pytest.raises(BadFileError, match=message):
        read_records(tmp_path)
    with pytest.raises(BadFileError, match=message):
        folder.rewind(0)
    assert (tmp_path / "metrics.jsonl").read_text() == before  # nothing was rewound


def test_resume_names_a_last_metrics_line_that_is_not_a_record(smoke_run, tmp_path):
    run = killed_copy(smoke_run, tmp_path)
    lines = len((run / "metrics.jsonl").read_text().splitlines())
    with open(run / "metrics.jsonl", "a") as fh:
        fh.write('{"kind": "eval"}\n')
    with pytest.raises(BadFileError, match=re.escape(f"{run / 'metrics.jsonl'}, line {lines + 1}: expected a record")):
        resume_in_process(run)


def test_interrupted_atomic_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "status.json"
    path.write_text("old")

    def half_then_killed(tmp: Path) -> None:
        tmp.write_text("ne")
        raise SimulatedCrash("killed while writing")

    with pytest.raises(SimulatedCrash):
        write_atomic(path, half_then_killed)
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.glob(TEMPORARY_GLOB)] == [".tmp.status.json"]


# --- status.json is never left "running" by a process that has ended -------------------

NO_SPACE = OSError(28, "No space left on device")


def test_a_run_that_fails_after_its_last_round_is_marked_failed_with_the_reason(tmp_path, monkeypatch):
    """Disk full while drawing the final plots: the run's status says failed, and why."""
    import fedmech_flwr.app.run as server

    def full_disk(run_dir, *args, **kwargs):
        raise NO_SPACE

    monkeypatch.setattr(server, "plot_run", full_disk)
    with pytest.raises(OSError, match="No space left"):
        run_in_process(smoke_config(), tmp_path)
    [run] = run_folders(tmp_path)
    status = read_status(run)
    assert status["status"] == "failed"
    assert re.fullmatch(r"after the last round, writing its outputs: in test_resilience "
                        r"\(\S+test_resilience.py:\d+\): OSError: \[Errno 28\] No space left on device", status["error"])
    assert (run / "model_final.safetensors").is_file()  # the rounds' work is all there


def test_a_resume_that_fails_while_rewinding_is_marked_failed(smoke_run, tmp_path, monkeypatch):
    run = killed_copy(smoke_run, tmp_path)
    monkeypatch.setattr(RunFolder, "rewind", lambda self, last_round: (_ for _ in ()).throw(NO_SPACE))
    with pytest.raises(OSError, match="No space left"):
        resume_in_process(run)
    status = read_status(run)
    assert (status["status"], status["resumable"]) == ("failed", True)
    assert status["error"].endswith("): OSError: [Errno 28] No space left on device")  # where: the test's stand-in


def test_the_cli_marks_a_run_failed_whose_serverapp_ended_without_a_status(tmp_path, capsys, monkeypatch):
    """Even the status write failed in the ServerApp (a full disk it later had room on
    again): the CLI finds "running" by a dead process and records the failure."""
    def launch_whose_server_died(run_config, *args, **kwargs):
        run = Path(run_config["run-dir"])
        run.mkdir(parents=True, exist_ok=True)
        as_killed(run)
        return LaunchResult(7, "finished:failed")

    monkeypatch.setattr(cli, "launch", launch_whose_server_died)
    assert main(["run", str(SMOKE), "--out", str(tmp_path)]) == EXIT_FAILED
    [run] = run_folders(tmp_path)
    reason = "the ServerApp ended without recording an outcome (Flower: finished:failed); see its log"
    assert read_status(run)["status"] == "failed" and read_status(run)["error"] == reason
    out, err = capsys.readouterr()
    assert out.startswith(f"fedmech run: smoke -> {run} | 3 clients x 2 rounds | simulation")
    assert err.strip() == (f"failed: {reason} | once fixed, continue it: fedmech run --resume {run} | logs in "
                           f"{run / 'logs'} | page: {run / 'report' / 'index.html'}")


# --- resume checks everything before Flower starts -------------------------------------

@pytest.mark.parametrize("damage", [b'{"kind": "eval"}\n', b"\xff\xfe garbage\n", b'{"kind": "eval", "round": 9}\n'
                                    b"not json\n" b'{"kind": "eval", "round": 9}\n'],
                         ids=["last line not a record", "last line not UTF-8 (torn: skipped)", "line before the end"])
def test_cli_resume_checks_the_records_before_flower_starts(smoke_run, tmp_path, capsys, monkeypatch, damage):
    run = killed_copy(smoke_run, tmp_path).resolve()
    lines = len((run / METRICS_FILE).read_bytes().splitlines())
    with open(run / METRICS_FILE, "ab") as fh:
        fh.write(damage)
    status = (run / "status.json").read_bytes()
    started = []
    monkeypatch.setattr(cli, "launch", lambda *_, **__: started.append(1) or LaunchResult(None, "not started"))
    code = main(["run", "--resume", str(run)])
    if b"\xff" in damage:  # a kill can cut a multi-byte character: the torn last line is skipped, as any
        assert started
        return
    assert code == EXIT_BAD_INPUT and not started
    [line] = capsys.readouterr().err.splitlines()
    bad = lines + (1 if damage.startswith(b'{"kind": "eval"}') else 2)
    assert line.startswith(f"error: {run / METRICS_FILE}, line {bad}: expected "), line
    assert line.endswith(f"; the file was damaged: restore it or delete that line, then run `fedmech run --resume "
                         f"{run}` again"), line
    assert (run / "status.json").read_bytes() == status and not (run / LOCK_FILE).exists()


def test_cli_resume_of_a_damaged_status_file_exits_2(smoke_run, tmp_path, capsys, monkeypatch):
    run = killed_copy(smoke_run, tmp_path).resolve()
    (run / "status.json").write_bytes(b'{"status": "runn')
    monkeypatch.setattr(cli, "launch", lambda *_, **__: pytest.fail("Flower was started"))
    assert main(["run", "--resume", str(run)]) == EXIT_BAD_INPUT
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: {run / 'status.json'} is not JSON (") and "to resume the run" in line

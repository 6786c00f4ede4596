"""The ``fedmech`` CLI (validate, plot, exit codes); the plug-in import boundary is
``test_import_graph.py``'s."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, needs_dataset
from fedmech_flwr.foundation.safe_text import CONTROL
from fedmech_flwr.tools.cli import EXIT_BAD_INPUT, EXIT_OK, main


# --- validate ---------------------------------------------------------------------------

def test_validate_ok(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert main(["validate", "experiments/smoke.yaml"]) == EXIT_OK == 0
    out, err = capsys.readouterr()
    assert out.startswith("OK: experiments/smoke.yaml: 'smoke': synthetic / dirichlet, simple_cnn, ")
    assert "3 clients x 2 rounds, strategy fedavg, client plain, pruning magnitude" in out
    assert err == ""


def test_validate_with_override(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert main(["validate", "experiments/smoke.yaml", "--set", "federation.num_rounds=9",
                 "--set", "pruning.mode=dense"]) == 0
    assert "3 clients x 9 rounds" in capsys.readouterr().out


def test_validate_bad_value_exits_2_with_message(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert main(["validate", "experiments/smoke.yaml", "--set", "data.partition.alpha=-1"]) == EXIT_BAD_INPUT == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("error: alpha must be > 0, got -1")
    assert "experiments/smoke.yaml: data.partition.alpha" in err


MEASURED_VALIDATE = """
import resource, sys
from fedmech_flwr.tools.cli import main
code = main(sys.argv[1:])
print(code, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


@pytest.mark.parametrize("sizes", [["data.dataset.image_size=100000"],
                                   ["data.dataset.image_size=4096", "data.dataset.num_train=1000000"]])
def test_validate_of_a_size_no_machine_holds_refuses_in_one_line_allocating_nothing(sizes):
    """The issue's typo (``image_size: 100000`` took 22 GB, then the kernel's OOM killer)
    and a size within the bounds but beyond the machine's memory: one line, exit 2, and
    the process peaks where importing torch does (well under 2 GiB), not at the data."""
    sets = [arg for size in sizes for arg in ("--set", size)]
    done = subprocess.run([sys.executable, "-c", MEASURED_VALIDATE, "validate", "experiments/smoke.yaml", *sets],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    code, peak_kib = map(int, done.stdout.split())
    assert code == EXIT_BAD_INPUT and done.stderr.count("\n") == 1 and done.stderr.startswith("error: ")
    assert peak_kib < 2 * 2**20, f"validate peaked at {peak_kib / 2**20:.1f} GiB"


def test_validate_malformed_override_and_missing_file(capsys, tmp_path):
    assert main(["validate", str(REPO / "experiments" / "smoke.yaml"), "--set", "seed"]) == 2
    assert "expected key=value, got 'seed'" in capsys.readouterr().err
    assert main(["validate", str(tmp_path / "nope.yaml")]) == 2
    assert "experiment file not found" in capsys.readouterr().err


def test_validate_checks_a_sweep_file_cell_by_cell(capsys, monkeypatch):
    """The demo's file is a sweep: a newcomer's `fedmech validate` of it checks its cells."""
    monkeypatch.chdir(REPO)
    assert main(["validate", "experiments/smoke_sweep.yaml"]) == EXIT_OK
    assert capsys.readouterr().out == ("OK: experiments/smoke_sweep.yaml: sweep 'smoke-sweep', 8 cells, each validated "
                                       "(fedmech sweep experiments/smoke_sweep.yaml --dry-run lists them)\n")
    assert main(["validate", "experiments/smoke_sweep.yaml", "--set", "seed=1"]) == EXIT_BAD_INPUT
    assert "--set changes an experiment; a sweep's cells are set in its file" in capsys.readouterr().err


# --- validate and run refuse the same bad input, before anything starts -----------------

SMOKE_AT = "in experiments/smoke.yaml: "
needs_fashion_mnist = needs_dataset("fashion_mnist")
needs_cifar10 = needs_dataset("cifar10")

BAD_INPUT = [
    # caught only inside the ServerApp before (issue 12)
    (["federation.num_clients=400"],
     "num_clients must be between 1 and the number of training samples (300), got 400 " + SMOKE_AT + "federation.num_clients"),
    (["data.dataset.num_classes=10", "data.partition={name: class_map, classes: {0: [0], 1: [11], 2: [2]}}"],
     "client 1: class 11 is outside 0..9 " + SMOKE_AT + "data.partition.classes.1"),
    (["data.dataset={name: fashion_mnist, root: /nonexistent}"],
     "dataset 'fashion_mnist' with {'root': '/nonexistent'} is not on this machine " + SMOKE_AT + "data.dataset"),
    (["data.audit_per_class=15", "strategy={name: fedavg_head_realign}"],
     "a balanced head set of 200 needs 50 per class, but the audit set has 14 per class to spare for it; "
     "raise data.audit_per_class or lower the samples " + SMOKE_AT + "strategy.head_samples"),
    (["model.channels=[4, 8, 8, 8]"],
     "image_size 12 is too small for 4 conv blocks (each max-pool halves it); use at most 3 channels entries or "
     "larger images " + SMOKE_AT + "model.channels"),
    (["data.audit_per_class=80"],
     "audit_per_class (80) must be below the 75 training samples of class 0 " + SMOKE_AT + "data.audit_per_class"),
    (["data.partition={name: dirichlet, min_samples: 101}"],
     "dirichlet: 3 clients x min_samples=101 needs more than the 300 samples there are; lower min_samples or use "
     "fewer clients " + SMOKE_AT + "data.partition.min_samples"),
    (["data.partition={name: dirichlet, alpha: 0.01, min_samples: 90, max_attempts: 3}"],
     ("no draw in 3 attempts gave every client min_samples=90", SMOKE_AT + "data.partition.alpha")),
    (["data.partition={name: classes_per_client, k: 5}"],
     "k must be <= the number of classes (4), got 5 " + SMOKE_AT + "data.partition.k"),
    (["data.partition={name: class_map, classes: {0: [0], 1: [1]}}"],
     "classes must name exactly clients 0..2 (federation.num_clients is 3); missing [2], extra [] "
     + SMOKE_AT + "data.partition.classes"),
    (["diagnostics=[{name: misalignment}]"], "(data.audit_per_class is 0); set data.audit_per_class (e.g. 100) "
     + SMOKE_AT + "diagnostics[0]"),
    (["diagnostics=[{name: circuits, audit: true}]"],
     "circuits.audit is true but the run has no audit set (data.audit_per_class is 0); set data.audit_per_class > 0 "
     + SMOKE_AT + "diagnostics[0].audit"),
    (["diagnostics=[{name: usae, layer: conv1, compare: reference}]"],
     "compare: reference needs reference: RUN_DIR or CONFIG.yaml:WEIGHTS, got None " + SMOKE_AT + "diagnostics[0].reference"),
    # caught at validation already
    (["strategy={name: fedavgg}"], ("unknown strategy 'fedavgg'; did you mean 'fedavg'? registered: ",
                                    SMOKE_AT + "strategy.name")),
    (["data.partition.alpha=-1"], "alpha must be > 0, got -1.0 " + SMOKE_AT + "data.partition.alpha"),
    (["strategy={name: fedprox}"],
     "strategy 'fedprox' needs client 'proximal', got 'plain'; set client.name accordingly " + SMOKE_AT + "client.name"),
    (["federation.clients_per_round=4"],
     "clients_per_round (4) must be <= num_clients (3) " + SMOKE_AT + "federation.clients_per_round"),
    (["name=a\x1b]0;x\x07"], "character '\\x1b' (U+001B) on line 1, column 2 is not allowed in YAML text: remove it "
                              "in --set name"),
    (['name="a\\e]0;x\\a"'], ("got 'a\\x1b]0;x\\x07', which holds the control character '\\x1b'",
                              SMOKE_AT + "name")),
    (["name=-A1"], ("starting with a letter, a digit or '_'", "got '-A1'", SMOKE_AT + "name")),
    # on real data
    pytest.param(["data.dataset={name: fashion_mnist}", "federation.num_clients=60001"],
                 "number of training samples (60000), got 60001 " + SMOKE_AT + "federation.num_clients",
                 marks=needs_fashion_mnist, id="fashion_mnist-clients"),
    pytest.param(["data.dataset={name: cifar10}", "data.partition={name: class_map, classes: {0: [0], 1: [11], 2: [2]}}"],
                 "client 1: class 11 is outside 0..9 " + SMOKE_AT + "data.partition.classes.1",
                 marks=needs_cifar10, id="cifar10-class-map"),
    pytest.param(["data.dataset={name: cifar10}", "data.audit_per_class=5000"],
                 "audit_per_class (5000) must be below the 5000 training samples of class 0 " + SMOKE_AT
                 + "data.audit_per_class",
                 marks=needs_cifar10, id="cifar10-audit"),
]


def _no_launch(*args, **kwargs):
    raise AssertionError("fedmech run started Flower for input it should have refused")


@pytest.mark.parametrize(("overrides", "message"), BAD_INPUT, ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_validate_and_run_refuse_the_same_bad_input_before_anything_starts(overrides, message, capsys, monkeypatch, tmp_path):
    """``validate`` never says OK to a config that ``run`` refuses at start: both exit 2 and
    the first line of stderr names the key, the value and what is allowed (``message``: one
    fragment of that line, or several)."""
    import fedmech_flwr.tools.cli as cli

    fragments = (message,) if isinstance(message, str) else message

    monkeypatch.chdir(REPO)
    monkeypatch.setattr(cli, "launch", _no_launch)
    sets = [arg for item in overrides for arg in ("--set", item)]
    for command in (["validate"], ["run", "--out", str(tmp_path)]):
        assert main([*command, "experiments/smoke.yaml", *sets]) == EXIT_BAD_INPUT, command
        out, err = capsys.readouterr()
        assert out == "" and all(f in err.splitlines()[0] for f in fragments), (command, err)
        assert err.startswith("error: ")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("value", ["a\x1b]0;x\x07", "a\nforged line", "a\u202eb"])
def test_a_control_character_in_a_value_is_one_escaped_line(value, capsys, monkeypatch):
    """Raw on the command line (YAML's reader refuses it) or past it (a bidi override): exit
    2 with one line that names the key and shows the character escaped."""
    monkeypatch.chdir(REPO)
    assert main(["validate", "experiments/smoke.yaml", "--set", f"name={value}"]) == EXIT_BAD_INPUT
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("error: ") and "name" in err
    assert not CONTROL.search(err.rstrip("\n")), err


def test_run_of_a_good_config_gets_as_far_as_launch(monkeypatch, tmp_path):
    """The table above is not vacuous: with valid input, ``run`` does reach ``launch``."""
    import fedmech_flwr.tools.cli as cli

    monkeypatch.chdir(REPO)
    monkeypatch.setattr(cli, "launch", _no_launch)
    with pytest.raises(AssertionError, match="started Flower"):
        main(["run", "experiments/smoke.yaml", "--out", str(tmp_path)])



# --- files and names the CLI refuses before anything starts -------------------------------

SMOKE_TEXT = (REPO / "experiments" / "smoke.yaml").read_text()
ALIAS_BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{b}: &{b} [{', '.join([f'*{a}'] * 9)}]\n" for a, b in zip("abcdefgh", "bcdefghi")) + "name: *i\n"
"""A 9-level "billion laughs": 9^9 strings under ``name:`` once its aliases are expanded."""


def _experiment(tmp_path: Path, text: str | bytes, name: str = "exp.yaml") -> Path:
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def _sweep(tmp_path: Path, text: str) -> Path:
    return _experiment(tmp_path, text.replace("BASE", str(REPO / "experiments" / "smoke.yaml")), "sweep.yaml")


BAD_FILES = [
    # (id, commands, files to write, (fragments of the one line, naming the file or key))
    ("duplicate top-level key", [["validate"], ["run"]],
     lambda t: _experiment(t, SMOKE_TEXT + "federation: {num_clients: 2, num_rounds: 1}\n"),
     ("key 'federation' appears twice, on line 13 and on line 16", "exp.yaml")),
    ("duplicate nested key", [["validate"], ["run"]],
     lambda t: _experiment(t, SMOKE_TEXT.replace("seed: 0", "seed: 0\nseed: 1")),
     ("key 'seed' appears twice, on line 3 and on line 4", "exp.yaml")),
    ("alias bomb under name", [["validate"], ["run"]],
     lambda t: _experiment(t, SMOKE_TEXT.replace("name: smoke\n", "") + ALIAS_BOMB),
     ("aliases expand to more than 100,000 nodes", "exp.yaml")),
    ("nested too deeply", [["validate"], ["run"]],
     lambda t: _experiment(t, SMOKE_TEXT.replace("seed: 0", "seed: " + "[" * 3000 + "]" * 3000)),
     ("nested too deeply to be a config", "exp.yaml")),
    ("not UTF-8", [["validate"], ["run"]],
     lambda t: _experiment(t, SMOKE_TEXT.encode().replace(b"name: smoke", b"name: sm\xf6ke")),
     ("not UTF-8 text: byte 96 (0xf6) cannot be decoded", "exp.yaml")),
    ("a file that is not a mapping", [["validate"], ["run"]],
     lambda t: _experiment(t, "just a sentence\n"),
     ("expected an experiment or sweep file, a mapping of keys", "got text of 15 characters in ")),
    ("a sweep whose base is not a mapping", [["sweep"], ["sweep", "--dry-run"], ["validate"]],
     lambda t: _sweep(t, f"base: {_experiment(t, 'just a sentence')}\n"),
     ("expected an experiment or sweep file, a mapping of keys", "got text of 15 characters in ", "exp.yaml")),
    ("a raw ESC in the file", [["validate"], ["run"]],
     lambda t: _experiment(t, SMOKE_TEXT.replace("name: smoke", "name: sm\x1b]0;x\x07oke")),
     ("character '\\x1b' (U+001B) on line 2, column 9 is not allowed in YAML text: remove it in ", "exp.yaml")),
    ("a preset name that leaves --out", [["sweep", "--preset", "../../../p"], ["sweep", "--dry-run", "--preset", "../../../p"]],
     lambda t: _sweep(t, 'base: BASE\npresets: {"../../../p": {set: {seed: 1}}}\n'),
     ("'../../../p' names the sweep folder", "presets.../../../p")),
    ("a grid axis the seeds would replace", [["sweep"], ["sweep", "--dry-run"]],
     lambda t: _sweep(t, "base: BASE\ngrid: {seed: [1, 2]}\n"), ("the sweep sets seed of every cell", "grid.seed")),
    ("--parallel 0 in a dry run", [["sweep", "--dry-run", "--parallel", "0"], ["sweep", "--parallel", "0"]],
     lambda t: _sweep(t, "base: BASE\n"), ("--parallel must be >= 1, got 0",)),
    ("--parallel -3 in a dry run", [["sweep", "--dry-run", "--parallel", "-3"], ["sweep", "--parallel", "-3"]],
     lambda t: _sweep(t, "base: BASE\n"), ("--parallel must be >= 1, got -3",)),
    ("run --out under a file", [["run", "--out", "{file}/runs"]],
     lambda t: _experiment(t, SMOKE_TEXT), ("cannot write in", "(Not a directory); choose another --out")),
    ("sweep --out under a file", [["sweep", "--out", "{file}/runs"], ["sweep", "--dry-run", "--out", "{file}/runs"]],
     lambda t: _sweep(t, "base: BASE\n"), ("cannot write in", "choose another --out")),
]


@pytest.mark.parametrize(("commands", "write", "fragments"), [row[1:] for row in BAD_FILES],
                         ids=[row[0] for row in BAD_FILES])
def test_bad_files_and_names_are_refused_in_one_line_before_anything_starts(commands, write, fragments, capsys,
                                                                              monkeypatch, tmp_path):
    """Each exits 2 with one line naming the file or key, leaves no folder, starts nothing."""
    import fedmech_flwr.tools.cli as cli
    import fedmech_flwr.tools.sweep as sweep

    monkeypatch.setattr(cli, "launch", _no_launch)
    monkeypatch.setattr(sweep, "WarmSimulations", _no_launch)
    files = tmp_path / "files"
    files.mkdir()
    path = write(files)
    out = tmp_path / "out"
    (blocker := tmp_path / "a-file").write_text("not a folder")
    for command in commands:
        args = [a.replace("{file}", str(blocker)) for a in command[1:]]
        if "--out" not in args:
            args += ["--out", str(out)]
        assert main([command[0], str(path), *args] if command[0] != "validate" else ["validate", str(path)]) \
            == EXIT_BAD_INPUT, command
        captured = capsys.readouterr()
        assert not captured.out.startswith("OK"), command
        [line] = captured.err.splitlines()
        assert line.startswith("error: ") and all(f in line for f in fragments), (command, line)
        assert len(line) < 600, line  # a bounded repr, whatever the value
    assert not out.exists() and not (tmp_path / "p").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "files"]


def test_out_on_a_read_only_file_system_is_one_line(tmp_path):
    """A real read-only mount (a private mount namespace: nothing outside this test sees
    it); skipped where unshare may not make one."""
    ro = tmp_path / "ro"
    ro.mkdir()
    if subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o ro tmpfs {ro}"],
                      capture_output=True).returncode != 0:
        pytest.skip("unshare cannot mount a read-only tmpfs here")
    script = (f"mount -t tmpfs -o ro tmpfs {ro} && exec {sys.executable} -m fedmech_flwr.tools.cli "
              f"run experiments/smoke.yaml --out {ro}/runs")
    done = subprocess.run(["unshare", "-rm", "sh", "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == EXIT_BAD_INPUT, done.stderr
    [line] = done.stderr.splitlines()
    assert line.startswith(f"error: cannot write in {ro}/runs/smoke-") and "(Read-only file system)" in line, line


# --- plot -------------------------------------------------------------------------------

def test_plot_regenerates_deleted_plots(smoke_run, tmp_path, capsys):
    run = Path(shutil.copytree(smoke_run, tmp_path / "run"))
    before = sorted(p.name for p in (run / "plots").glob("*.png"))
    assert "accuracy.png" in before and "weight_divergence_support_iou.png" in before
    shutil.rmtree(run / "plots")
    assert main(["plot", str(run)]) == 0
    after = sorted(p.name for p in (run / "plots").glob("*.png"))
    assert after == before
    printed = capsys.readouterr().out.split()
    assert sorted(Path(p).name for p in printed) == before
    for name in after:
        assert (run / "plots" / name).read_bytes()[:4] == b"\x89PNG"


def test_plot_of_a_non_run_folder_exits_2(tmp_path, capsys):
    assert main(["plot", str(tmp_path)]) == 2
    assert f"is {tmp_path} a fedmech run folder?" in capsys.readouterr().err


def test_unknown_command_exits_nonzero():
    with pytest.raises(SystemExit) as info:
        main(["frobnicate"])
    assert info.value.code == 2


# --- fedmech run: the run config handed to ``flwr run --run-config`` --------------------

def test_run_config_survives_flowers_run_config_parser():
    import json

    from flwr.common.config import parse_config_args

    from fedmech_flwr.tools.local_flower import toml_quoted

    run_config = {
        "experiment": "/some dir/exp.yaml",
        "overrides": json.dumps(["federation.num_rounds=2", "name=it's \"q\"", "data.dataset.root=C:\\x"]),
        "out": "/tmp/out",
        "run-dir": "",
    }
    text = " ".join(f"{k}={toml_quoted(v)}" for k, v in run_config.items())
    assert parse_config_args([text]) == run_config
    assert json.loads(parse_config_args([text])["overrides"])[1] == "name=it's \"q\""


# --- conventions ------------------------------------------------------------------------

def test_version_names_the_package_and_what_it_runs_on(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert re.fullmatch(r"fedmech-flwr \S+ \(Flower 1\.42\.\S+, torch 2\.14\.1, Ray \S+\)\n", capsys.readouterr().out)


def test_every_subcommand_describes_itself_its_exit_codes_and_two_examples(capsys):
    """The built-in ones and those plug-ins register (``usae``, ``misalignment-table``)."""
    from fedmech_flwr.contracts.commands import COMMANDS
    from fedmech_flwr.tools.cli import HELP, build_parser

    with pytest.raises(SystemExit):
        main(["--help"])
    top = capsys.readouterr().out
    registered = {name: COMMANDS.get(name).factory.help for name in COMMANDS.names()}
    assert {"usae", "misalignment-table"} <= set(registered)
    for name, text in {**HELP, **registered}.items():
        assert re.search(rf"^    {re.escape(name)}\s", top, re.M), name  # listed in the top-level help
        with pytest.raises(SystemExit):
            build_parser().parse_args([name, "--help"])
        page = capsys.readouterr().out
        assert "exit codes:\n  0  " in page and page.count("\n  fedmech ") == 2, name
        assert text.paragraph.split()[0] in page


def test_a_closed_pipe_ends_quietly_with_exit_0():
    """``fedmech list | head -1``: no BrokenPipeError traceback."""
    done = subprocess.run(f"{sys.executable} -m fedmech_flwr.tools.cli list | head -1; exit ${{PIPESTATUS[0]}}",
                          shell=True, executable="/bin/bash", cwd=REPO, capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stderr) == (0, "") and done.stdout.startswith("DATASETS")


def test_ctrl_c_sigterm_and_sighup_stop_a_command_only_inside_it(capsys):
    """``main`` leaves a process's own handlers alone (a test runner's SIGTERM stays its
    own); inside a run's block Ctrl-C, SIGTERM and SIGHUP raise ``Stopped``, a
    ``KeyboardInterrupt``, with the shell's exit code, and the handlers come back after it."""
    import signal

    from fedmech_flwr.tools.finish import Stopped, exit_code, stopped_by_signals

    caught = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    before = [signal.getsignal(s) for s in caught]
    assert main(["list", "strategies"]) == 0
    assert [signal.getsignal(s) for s in caught] == before
    for sig, code in ((signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129)):
        with pytest.raises(Stopped) as info, stopped_by_signals():
            os.kill(os.getpid(), sig)
            for _ in range(100):  # the handler runs between two bytecodes of this thread
                time.sleep(0.01)
        assert isinstance(info.value, KeyboardInterrupt) and exit_code(info.value) == code
        assert [signal.getsignal(s) for s in caught] == before
    assert exit_code(KeyboardInterrupt()) == 130


def test_a_failure_the_stop_caused_is_an_interruption_and_one_before_it_stays(tmp_path):
    """A stop ends every process of a run at once: where the clients' actors go first, the
    ServerApp records their loss as a failure, after the stop came. That run is interrupted
    and resumable; a run that failed before the stop keeps its failure."""
    import signal

    from fedmech_flwr.artifacts.folder import RunFolder, read_status
    from fedmech_flwr.tools.finish import Stopped, interrupt_run

    before, after = RunFolder.create(tmp_path, "before"), RunFolder.create(tmp_path, "after")
    before.record_end("failed", "ClientFailure: round 1: client 0 failed (non-finite weights)", True)
    mended = RunFolder.create(tmp_path, "mended")
    (mended.path / "status.json").write_text('{"status": "failed"}')  # as a damaged file's error says to write
    stop = Stopped(signal.SIGHUP)
    after.record_end("failed", "ClientFailure: round 2: 2 of 2 clients failed (lost their actors)", True)
    for folder in (before, mended, after):
        interrupt_run(folder.path, stop)
    assert read_status(before.path)["error"].startswith("ClientFailure: round 1")
    assert read_status(mended.path) == {"status": "failed"}
    status = read_status(after.path)
    assert (status["status"], status["error"], status["resumable"]) == ("interrupted", "stopped by SIGHUP", True)

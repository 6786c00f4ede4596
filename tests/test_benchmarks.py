"""Every benchmark runs at a tiny size (a smoke test: nothing here gates on time)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
TINY = ["--set", "data.dataset={name: synthetic, num_train: 300, num_test: 100, num_classes: 4, image_size: 12}",
        "--set", "model.channels=[4, 8]", "--set", "federation.num_clients=3", "--set", "train.epochs=1",
        "--set", "device=cpu", "--set", "data.partition={name: iid}"]


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def last_column(out: str) -> list[float]:
    """The ratio column of a benchmark's table rows (after the header)."""
    return [float(line.split()[-1]) for line in out.strip().splitlines()[1:]]


def test_circuits_round(capsys):
    load("circuits_round").main(["--rounds", "2", *TINY, "--set",
                                 "diagnostics=[{name: circuits, gates: {steps: 20, batch_size: 16, patience: 3, "
                                 "min_steps: 5}, min_class_samples: 5, ablation_samples: 40}]"])
    ratios = last_column(capsys.readouterr().out)
    assert len(ratios) == 2 and all(r > 0 for r in ratios)


def test_misalignment_round(capsys):
    load("misalignment_round").main([*TINY, "--set", "data.audit_per_class=10", "--set",
                                     "diagnostics=[{name: misalignment, head_samples: 20, client_stats: [ncm, ccvr]}]"])
    (ratio,) = last_column(capsys.readouterr().out)
    assert ratio > 0


def test_similarity_round(capsys):
    load("similarity_round").main([*TINY, "--set", "data.audit_per_class=10"])
    header, row = capsys.readouterr().out.strip().splitlines()
    assert "representation_similarity s" in header and "neural_collapse s" in header
    ratios = [float(v) for v in row.split()[3::2]]
    assert len(ratios) == 2 and all(r > 0 for r in ratios)


@pytest.mark.integration
def test_throughput_engine_against_the_bare_loop(capsys):
    load("throughput").main(["--samples", "128", "--repeats", "2", "--skip-flower"])
    rows = capsys.readouterr().out.strip().splitlines()[1:]
    assert [row.split("  ")[0] for row in rows] == ["bare PyTorch loop (no project code)",
                                                    "the engine outside Flower (train_epochs)"]
    assert all(float(row.split()[-1]) > 0 for row in rows)


@pytest.mark.integration
def test_circuits_agreement(capsys):
    load("circuits_agreement").main(["--channels", "4", "8", "--samples", "300", "--steps", "3",
                                     "--sparsity", "0.9", "--ablation-samples", "50"])
    out = capsys.readouterr().out
    assert "circuits mean IoU default (early stop) vs paper, conv outputs" in out
    assert "circuits mean IoU paper, fast path vs paper, conv outputs" in out
    assert "grouped forward: yes" in out  # pruned: the fast path
    assert "numbers inside" in out and "probe accuracy" in out


@pytest.mark.integration
def test_startup(capsys):
    """One lone run and a 2-cell sweep: every phase is found in the logs and is not
    negative, and the nine add up to the wall time (each printed to 0.1 s)."""
    load("startup").main(["--repeats", "1", "--cells", "2", "--warm-up", "0"])
    out = capsys.readouterr().out
    lone = {line.split()[0]: float(line.split()[1]) for line in out.splitlines()[1:13]}
    names = ["start", "simulate", "serverapp", "rounds", "finish", "teardown", "status", "page", "exit"]
    assert list(lone) == ["wall", "strategy", "fixed", *names]
    assert sum(lone[k] for k in names) == pytest.approx(lone["wall"], abs=0.45) and min(lone[k] for k in names) >= 0
    assert 0 < lone["strategy"] < lone["wall"]
    assert "first cell" in out and "cell 2" in out and "fixed cost per cell after the first" in out


@pytest.mark.integration
def test_scale(capsys):
    """Two tiny federations: every start-up phase is found in the logs, each run's row is
    printed, then the medians with their ratios to the first count (1 for the first)."""
    load("scale").main(["--clients", "3", "6", "--per-round", "2", "--rounds", "3", "--repeats", "1"])
    out = capsys.readouterr().out.strip().splitlines()
    runs = [line.split() for line in out[1:3]]
    assert [row[0] for row in runs] == ["3", "6"] and all(float(v) > 0 for row in runs for v in row[4:])
    assert out[4] == "medians of 1 runs each"
    medians = [line.split() for line in out[6:8]]
    assert [row[0] for row in medians] == ["3", "6"] and medians[0][-3:] == ["1.000", "1.000", "1.00"]
    assert out[8].startswith("targets, 6 vs 3 clients: round time x")


def test_link_state(capsys):
    """One pass three ways over two tiny federations: every time and Flower's over the
    index's is printed (a tiny pass can print as 0.000 ms: nothing here gates on time)."""
    load("link_state").main(["--nodes", "10", "50", "--passes", "1"])
    rows = [line.split() for line in capsys.readouterr().out.strip().splitlines()[1:]]
    assert [row[0] for row in rows] == ["10", "50"] and all(len(row) == 5 for row in rows)
    assert all(float(v) >= 0 for row in rows for v in row[1:])


@pytest.mark.parametrize("epochs", [1, 2])
@pytest.mark.parametrize(("method", "train"), [("scaffold", "train.momentum=0"), ("fednova", "train.momentum=0.9")])
def test_scaffold_and_fednova_agree_with_niid_benchs_rules_written_independently(method, train, epochs, capsys):
    """3 rounds over unequal shards (so FedNova's clients take unequal steps), each method
    with the leaderboard's local SGD, at 1 and 2 local epochs: fedmech's run and
    NIID-Bench's rule, side by side, agree to float rounding in accuracy, loss and the
    method's own number (a wrong sign or scale of SCAFFOLD's correction, of c_i+ or of c's
    update, or of FedNova's a_i or tau_eff, moves all three in the first rounds; a step
    count or a_i over one epoch only shows at 2)."""
    load("niid_bench_rules").main(["--method", method, *TINY, "--set", "data.audit_per_class=10",
                                   "--set", "federation.num_rounds=3", "--set", "train.max_samples_per_round=null",
                                   "--set", "data.partition={name: dirichlet, alpha: 0.5, min_samples: 10}",
                                   "--set", train, "--set", f"train.epochs={epochs}"])
    rows = [line.split() for line in capsys.readouterr().out.strip().splitlines()[1:]]
    assert [row[0] for row in rows] == ["1", "2", "3"]
    for row in rows:
        ours, theirs = [float(v) for v in row[1:4]], [float(v) for v in row[4:7]]
        assert ours[0] == pytest.approx(theirs[0], abs=0.011)  # at most one of 100 test images
        assert ours[1:] == pytest.approx(theirs[1:], rel=1e-4)
        assert ours[2] > 0


@pytest.mark.skipif(not os.access("/sys/fs/cgroup/cpuacct", os.W_OK), reason="no writable cgroup-v1 cpuacct")
def test_suite_cpu_charges_a_test_with_the_cpu_of_the_process_it_starts(tmp_path):
    """Two tests under the plug-in, on two workers: the one whose child process spins for
    about a second is charged about a second, the idle one almost nothing."""
    (tmp_path / "test_two.py").write_text(
        "import subprocess, sys, time\n"
        "def test_spins():\n"
        "    subprocess.run([sys.executable, '-c', 'import time\\nt = time.process_time()\\n"
        "while time.process_time() - t < 1: pass'], check=True)\n"
        "def test_sleeps():\n    time.sleep(1)\n")
    env = {**os.environ, "PYTHONPATH": str(BENCHMARKS), "SUITE_CPU_OUT": str(tmp_path / "cpu")}
    env.pop("PYTEST_ADDOPTS", None)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "suite_cpu", "-n", "2", "-p", "no:cacheprovider",
                           str(tmp_path / "test_two.py")], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = {r["test"].split("::")[1]: r["cpu_s"] for path in (tmp_path / "cpu").glob("gw*.jsonl")
            for r in map(json.loads, path.read_text().splitlines())}
    assert rows.keys() == {"test_spins", "test_sleeps"}
    assert 0.9 < rows["test_spins"] < 3 and rows["test_sleeps"] < 0.3, rows
    summary = load("suite_cpu").summary(tmp_path / "cpu").splitlines()
    assert summary[0].startswith("2 tests, ")
    assert re.fullmatch(r"each worker's last test ended before the suite's last: gw0 \d+ s, gw1 \d+ s", summary[1])
    assert " 0 s" in summary[1]  # the worker that ran the last test

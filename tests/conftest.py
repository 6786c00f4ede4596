"""Shared fixtures: seeding, the smoke config, Flower messages built outside a run, and
one in-process smoke run reused by the end-to-end and CLI tests."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Error, Message, MessageType, MetricRecord, RecordDict
from flwr.common.constant import ErrorCode
from flwr.supercore.task_identity import TaskIdentity

from fedmech_flwr.artifacts.folder import STATE_FILE, read_records, read_status
from fedmech_flwr.artifacts.liveness import process_alive
from fedmech_flwr.contracts import plugins
from fedmech_flwr.contracts.hooks import ClientUpdate, RoundState
from fedmech_flwr.contracts.wire import REPORT_KEY
from fedmech_flwr.learning.arrays import NamedArrays, load_arrays, load_model_arrays, to_record
from fedmech_flwr.learning.heads import balanced_split
from fedmech_flwr.spec.config import ExperimentConfig
from fedmech_flwr.spec.experiment import load_experiment
from fedmech_flwr.tools.processes import descendants
from fedmech_flwr.tools.reaper import MARKER, launch_processes

REPO = Path(__file__).resolve().parents[1]
SMOKE = REPO / "experiments" / "smoke.yaml"


def pytest_terminal_summary(terminalreporter) -> None:
    """Report the faults that tests injected (see tests/faults.py), by kind."""
    from faults import INJECTED

    if INJECTED:
        terminalreporter.write_line(f"faults injected: {dict(sorted(INJECTED.items()))}")


LONGEST = (
    "test_sweep_run.py::test_stopped_killed_and_continued_sweep_ends_as_the_uninterrupted_one",
    "test_tutorial.py::test_the_tutorial_runs_as_written",
    "test_flower_app.py::test_flwr_run_of_the_example_matches_the_same_fedmech_run",
    "test_demo.py::test_the_demo_records_what_its_verdict_reads",
    "test_own_plugins.py::test_a_users_plugins_run_and_every_output_shows_what_they_declare",
    "test_deploy_node_data.py::test_deploy_local_on_the_shards_files_ends_bitwise_as_fedmech_run",
    "test_flwr_run.py::test_sigkill_mid_run_then_resume_ends_as_the_uninterrupted_run",
    "test_benchmarks.py::test_startup",
)
"""The tests that used the most CPU (benchmarks/suite_cpu.py in CI, 2026-12-07), most first."""


def pytest_collection_modifyitems(items) -> None:
    """Integration tests first, the longest of them (``LONGEST``) in front, the others in
    their collected order: the first worker starts on them at once, and the suite does not
    end on one long test running alone. (``--dist worksteal`` splits the list into one
    contiguous run per worker, and a worker that has run out takes the last half of another's
    queue: docs/results/performance.md#the-test-suite has what that costs.)"""
    def rank(item) -> tuple[bool, int]:
        name = f"{item.path.name}::{item.originalname}"
        return item.get_closest_marker("integration") is None, LONGEST.index(name) if name in LONGEST else len(LONGEST)

    items.sort(key=rank)


def pytest_sessionfinish(session) -> None:
    """A pytest-xdist worker hands its injected faults to the controller, which reports them."""
    if hasattr(session.config, "workeroutput"):
        from faults import INJECTED

        session.config.workeroutput["faults"] = dict(INJECTED)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    from faults import INJECTED

    INJECTED.update(getattr(node, "workeroutput", {}).get("faults", {}))  # a crashed worker sent none


@pytest.fixture(autouse=True)
def _seed_and_threads():
    """Every test starts from seed 0 with one torch thread (2-core CI machine)."""
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    yield


@pytest.fixture
def disk(tmp_path):
    """A 16 MiB tmpfs (``faults.fill`` fills it); skipped where it cannot be mounted (root
    only); unmounted afterwards."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={16 * 2**20}", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}): the fault-injection tier needs root")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def smoke_config(overrides: list[str] | None = None) -> ExperimentConfig:
    """The validated smoke experiment, with ``key=value`` overrides applied."""
    plugins.load()
    return load_experiment(SMOKE, overrides or [])


@pytest.fixture
def smoke_cfg() -> ExperimentConfig:
    return smoke_config()


@pytest.fixture
def make_cfg() -> Callable[..., ExperimentConfig]:
    """``make_cfg("federation.num_rounds=1", ...)``: the smoke config with overrides."""
    return lambda *overrides: smoke_config(list(overrides))


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory) -> Path:
    """One completed in-process run of the smoke config (read-only for tests)."""
    from fedmech_flwr.app.inprocess import run_in_process

    torch.set_num_threads(1)
    return run_in_process(smoke_config(), tmp_path_factory.mktemp("smoke-run"))


def once_per_session(tmp_path_factory, name: str, make: Callable[[Path], None]) -> Path:
    """A folder that ``make`` fills once per test session, whichever pytest-xdist worker
    asks first; the others wait for it and get the same folder (read-only for tests).
    A module-scoped fixture would run once per worker that runs one of its tests: a
    real launch each time. If ``make`` fails, the next worker that asks tries again."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # the session's, shared by its workers
    folder, done = root / f"once-{name}", root / f"once-{name}.done"
    with open(root / f"once-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            make(folder)
            done.touch()
    return folder


@pytest.fixture
def plugin_site(tmp_path, monkeypatch) -> Path:
    """A folder on sys.path for plug-in modules a test writes; whatever they register, and
    the modules themselves, are forgotten after the test."""
    from fedmech_flwr.app import client_app
    from fedmech_flwr.contracts.commands import COMMANDS
    from fedmech_flwr.spec.config import plugin_registries
    from fedmech_flwr.contracts.strategy import CLIENT_QUERIES

    plugins.load()
    for registry in (*plugin_registries().values(), COMMANDS, CLIENT_QUERIES):
        monkeypatch.setattr(registry, "_entries", dict(registry._entries))
    monkeypatch.setattr(client_app, "_CONFIGS", {})
    folder = tmp_path / "site"
    folder.mkdir()
    monkeypatch.syspath_prepend(str(folder))
    yield folder
    for name, module in list(sys.modules.items()):
        if folder in Path(getattr(module, "__file__", None) or "/").parents:
            del sys.modules[name]


# --- comparing run folders -------------------------------------------------------------

MEASURED = re.compile(r"seconds|per-s$|per_s$|rss_mb$|^ray_node$")
"""Keys of timings, memory and the Ray node a client ran on: never reproducible."""


CHROMIUM = Path("/usr/bin/chromium")
"""Debian's Chromium, which the page tests open pages in (setup.sh installs it)."""


@contextlib.contextmanager
def browser_page():
    """A page of a headless Chromium that reaches nothing on the network by itself."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"])
        try:
            yield browser.new_page()
        finally:
            browser.close()


FENCE = re.compile(r"^```(\S*)\s*$")


def fenced_blocks(text: str) -> list[tuple[str, str, int, str]]:
    """The fenced blocks of a Markdown text: (language, text, line of the opening fence
    (1-based), the last non-blank line before it, where a marker comment stands). A block
    never closed is a ``ValueError`` naming its line."""
    lines = text.split("\n")
    out, i = [], 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        start = i
        i += 1
        while i < len(lines) and lines[i] != "```":
            i += 1
        if i == len(lines):
            raise ValueError(f"the block at line {start + 1} is never closed")
        previous = next((line for line in reversed(lines[:start]) if line.strip()), "")
        out.append((match.group(1), "\n".join(lines[start + 1 : i]) + "\n", start + 1, previous))
        i += 1
    return out


SHOWN_VARIES = re.compile(r"(?<![\w.])(?:\d+h)?(?:\d+m)?\d+(?:\.\d+)?s\b|\d{8}-\d{6}|\.\.\./")
"""What an example output may show differently from a rerun: durations and ETAs (``1.2s``,
``2m12s``), a run folder's time stamp (``20261205-101500``) and a path's start (``.../``)."""


def shown_output(shown: str) -> re.Pattern:
    """The pattern of an example output as a page shows it: its lines in order, each whole,
    exact but for ``SHOWN_VARIES``; a line ``...`` stands for any number of lines."""
    parts = []
    for line in shown.rstrip("\n").split("\n"):
        if line == "...":
            parts.append(r"(?:[^\n]*\n)*?")
            continue
        pattern, end = "", 0
        for match in SHOWN_VARIES.finditer(line):
            pattern += re.escape(line[end:match.start()])
            token = match.group(0)
            pattern += r"\S*/" if token == ".../" else r"\d{8}-\d{6}" if "-" in token else r"(?:\d+h)?(?:\d+m)?\d+(?:\.\d+)?s"
            end = match.end()
        parts.append(pattern + re.escape(line[end:]) + r"\n")
    return re.compile("^" + "".join(parts), re.MULTILINE)


def shows(shown: str, printed: str) -> bool:
    """Whether ``printed`` holds the example output ``shown`` (see ``shown_output``)."""
    return bool(shown_output(shown).search(printed if printed.endswith("\n") else printed + "\n"))


def needs_dataset(name: str) -> pytest.MarkDecorator:
    """Skip a test that needs dataset ``name`` where this machine lacks it, with the reason
    the product itself gives (where it looked, how to get it): a clone with no data beside
    it runs every other test."""
    from fedmech_flwr.datasets.data import dataset_info
    from fedmech_flwr.foundation.errors import DataNotFoundError

    try:
        dataset_info(name)
        missing = None
    except DataNotFoundError as err:
        missing = str(err).split("\n", 1)[0]
    return pytest.mark.skipif(missing is not None, reason=f"{name} is not on this machine: {missing}")


def without_measured(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not MEASURED.search(k)} for r in records]


def run_folders(out: Path) -> list[Path]:
    return sorted(p for p in out.iterdir() if p.is_dir()) if out.exists() else []


def compared_files(run: Path) -> dict[str, bytes]:
    """The files a resumed run must reproduce bitwise (records are compared apart:
    they hold timings; status, environment, plots, TensorBoard's event files, the logs
    and the page describe the process)."""
    skip = {"metrics.jsonl", "status.json", "environment.json"}
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*"))
            if p.is_file() and p.name not in skip
            and not {"plots", "tensorboard", "logs", "report"} & set(p.relative_to(run).parts)}


def lost_bytes(reference: Path, resumed: Path) -> int:
    """Bytes of the reference run's data that the resumed run lacks or has different:
    records (without timings) and files."""
    lines = lambda run: [json.dumps(r, sort_keys=True) for r in without_measured(read_records(run))]  # noqa: E731
    ref_lines, new_lines = lines(reference), lines(resumed)
    lost = sum(len(line) for line in ref_lines if line not in new_lines)
    new_files = compared_files(resumed)
    lost += sum(len(data) for name, data in compared_files(reference).items() if new_files.get(name) != data)
    return lost


def assert_same_run(reference: Path, resumed: Path) -> None:
    assert read_status(resumed)["status"] == "completed"
    assert without_measured(read_records(resumed)) == without_measured(read_records(reference))  # nothing lost or doubled
    assert sorted(compared_files(resumed)) == sorted(compared_files(reference))
    assert lost_bytes(reference, resumed) == 0


def killed_then_resumed(overrides: list[str], out: Path, partition_id: int, at_round: int) -> NamedArrays:
    """Run the smoke config with ``overrides`` once uninterrupted and once killed in client
    ``partition_id``'s training in round ``at_round``; resume the killed run in process and check
    it ends as the uninterrupted one. Returns the resume point the kill left (its ``round``
    and saved state), for what a test must find in it."""
    from faults import Fault, SimulatedCrash, faulty_app
    from fedmech_flwr.app.inprocess import resume_in_process, run_in_process

    reference = run_in_process(smoke_config(overrides), out / "reference")
    with pytest.raises(SimulatedCrash):
        run_in_process(smoke_config(overrides), out / "killed", faulty_app(Fault("crash", partition_id, at_round)))
    [run] = run_folders(out / "killed")
    as_killed(run)
    left = load_arrays(run / STATE_FILE)
    assert resume_in_process(run) == run
    assert_same_run(reference, run)
    return left


def as_killed(run: Path) -> None:
    """Leave status.json as a SIGKILL does: ``running``, by a process that is gone."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    (run / "status.json").write_text(json.dumps({"status": "running", "pid": gone.pid, "host": socket.gethostname()}))


# --- Flower messages outside a run ------------------------------------------------------

SERVER_NODE = 1


@pytest.fixture
def flower_identity(monkeypatch):
    """``Message`` reads the task identity of the process; set it as a server would."""
    monkeypatch.setattr(TaskIdentity, "_run_id", 1)
    monkeypatch.setattr(TaskIdentity, "_node_id", SERVER_NODE)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)


def outgoing(node_id: int) -> Message:
    """A train instruction to ``node_id`` (needs ``flower_identity``)."""
    return Message(RecordDict(), dst_node_id=node_id, message_type=MessageType.TRAIN)


def train_reply(
    node_id: int,
    arrays: NamedArrays,
    num_examples: int,
    metrics: dict[str, float] | None = None,
    partition_id: int | None = None,
    details: dict | None = None,
) -> Message:
    """A successful train reply as the ClientApp builds it (arrays, metrics, report)."""
    content = RecordDict({
        "arrays": to_record(arrays),
        "metrics": MetricRecord({"num-examples": num_examples, **(metrics or {})}),
        REPORT_KEY: ConfigRecord({
            "partition-id": node_id if partition_id is None else partition_id,
            "details": json.dumps(details or {}),
        }),
    })
    return Message(content, reply_to=outgoing(node_id))


def error_reply(node_id: int, reason: str = "boom") -> Message:
    """The reply Flower makes of a ClientApp that raised."""
    return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason), reply_to=outgoing(node_id))


@pytest.fixture
def messages(flower_identity):
    """Factories for train replies: ``messages.train(...)``, ``messages.error(...)``."""

    class _Messages:
        train = staticmethod(train_reply)
        error = staticmethod(error_reply)
        out = staticmethod(outgoing)

    return _Messages


def small_cnn():
    """The SimpleCNN [8, 16] of ``separable_cnn`` (4 classes, 1x8x8 images), untrained."""
    from fedmech_flwr.models import build_model

    return build_model("simple_cnn", {"channels": [8, 16]}, in_channels=1, num_classes=4, image_size=8)


def audit_round_state(global_arrays: NamedArrays, clients: dict[int, NamedArrays], data,
                      per_class: int = 40) -> RoundState:
    """Round 2's ``RoundState`` over ``small_cnn`` models: the global model, each client's
    model (10 examples each), the test set and a balanced audit set of ``per_class`` images
    a class from ``data``'s training split (the fixtures' 4 classes)."""
    audit, _ = balanced_split(data.y_train, per_class, 4, torch.Generator().manual_seed(0))

    def build(arrays: NamedArrays):
        model = small_cnn()
        load_model_arrays(model, arrays)
        return model.eval()

    updates = {pid: ClientUpdate(pid, arrays, 10, {}) for pid, arrays in clients.items()}
    datasets = {"test": (data.x_test, data.y_test), "audit": (data.x_train[audit], data.y_train[audit])}
    return RoundState(2, global_arrays, global_arrays, updates, datasets, 4, build, torch.device("cpu"), 0)


@pytest.fixture(scope="session")
def separable_cnn():
    """(model, data): ``small_cnn`` trained until its penultimate features separate the 4
    classes of a synthetic 8x8 set (test accuracy > 0.95). Read-only: copy its weights."""
    import torch.nn.functional as F

    from fedmech_flwr.datasets.data import SyntheticConfig, load_dataset

    torch.manual_seed(0)
    data = load_dataset("synthetic", SyntheticConfig(num_train=400, num_test=200, num_classes=4, image_size=8))
    model = small_cnn()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(60):
        optimizer.zero_grad()
        F.cross_entropy(model(data.x_train), data.y_train).backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        assert (model(data.x_test).argmax(1) == data.y_test).float().mean() > 0.95
    return model, data


def rolled_head(arrays: NamedArrays) -> NamedArrays:
    """A copy of ``arrays`` whose head rows are rolled by one class: the same features,
    and a head that reads class c as c + 1 (accuracy ~0)."""
    out = {k: v.copy() for k, v in arrays.items()}
    for key in ("head.weight", "head.bias"):
        out[key] = np.roll(out[key], 1, axis=0)
    return out


@pytest.fixture(scope="module")
def trained_cnn():
    """SimpleCNN [4, 8] trained briefly on a 4-class synthetic 8x8 set, and that set
    (built once per test module, so one module's changes never reach another)."""
    import torch.nn.functional as F

    from fedmech_flwr.datasets.data import SyntheticConfig, load_dataset
    from fedmech_flwr.models import build_model

    torch.manual_seed(0)
    data = load_dataset("synthetic", SyntheticConfig(num_train=160, num_test=80, num_classes=4, image_size=8))
    model = build_model("simple_cnn", {"channels": [4, 8]}, in_channels=1, num_classes=4, image_size=8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(40):
        batch = slice(32 * (step % 5), 32 * (step % 5 + 1))
        optimizer.zero_grad()
        F.cross_entropy(model(data.x_train[batch]), data.y_train[batch]).backward()
        optimizer.step()
    optimizer.zero_grad()
    return model.eval(), data


def assert_gone(pids, within_s: float, what: str) -> None:
    """Wait up to ``within_s`` seconds for every process of ``pids`` to end; fail with
    ``what`` should any still be alive."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and any(process_alive(pid) for pid in pids):
        time.sleep(0.2)
    assert not [pid for pid in pids if process_alive(pid)], what


def launch_processes_of(root: int) -> set[int]:
    """The processes of the launches that process ``root`` (a running ``fedmech`` command)
    started: its descendants' private folders (their marker), then every process of those
    launches by the reaper's rule. Another fedmech job on this host is never among them."""
    folders = set()
    for pid in descendants(root):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        folders.update(Path(v.split(b"=", 1)[1].decode()) for v in env if v.startswith(f"{MARKER}=".encode()))
    return {pid for folder in folders for pid in launch_processes(folder)}
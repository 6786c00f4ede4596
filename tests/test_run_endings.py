"""How a run ends, told truthfully: the fault-injection tier.

A run writes its folder on a small tmpfs that a ballast file fills just before one output
stage of the run's end (the final model, the plots, the event files, the status, and,
through the real CLI, the page). Each time: the run says so in one line, status.json
says failed and resumable (or, where the space kept for the status suffices, completed
with every output on disk), and once the ballast is gone ``--resume`` ends with the same
records and weights as an uninterrupted run, without running a round again, and event
files that TensorBoard's own reader loads whole. Mounting a tmpfs needs root; where it
cannot be mounted the tier is skipped. Also: a plug-in whose plot fails, and the signals
that end a run.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from conftest import assert_same_run, run_folders, smoke_config
from faults import fill
from fedmech_flwr.app import run as run_module
from fedmech_flwr.app.inprocess import resume_in_process, run_in_process
from fedmech_flwr.app.tensorboard_events import TENSORBOARD_DIR, EventFiles
from fedmech_flwr.artifacts.folder import RESERVE_FILE, RunFolder, read_records, read_status


def full_before(monkeypatch, owner, name: str, disk: Path, when=lambda *args: True) -> None:
    """Fill ``disk`` right before ``owner.name`` runs (the first time ``when`` holds)."""
    original = getattr(owner, name)
    filled = []

    def wrapper(*args, **kwargs):
        if not filled and when(*args):
            filled.append(fill(disk))
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapper)


def scalars(run: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of a run's event files, as TensorBoard's reader loads them; a torn
    record (the reader's "Truncated record" or data loss) fails the test."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    seen: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    logger, handler = logging.getLogger("tensorboard"), Catch(logging.DEBUG)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        acc = EventAccumulator(str(run / TENSORBOARD_DIR), size_guidance={"scalars": 0, "images": 0})
        acc.Reload()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert not [m for m in seen if "runcated" in m or "ata loss" in m.lower()], seen
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    return run_in_process(smoke_config(), tmp_path_factory.mktemp("reference"))


STAGES = {
    "final model": (RunFolder, "final_model", lambda *a: True),
    "plots": (run_module, "plot_run", lambda *a: True),
    "event files": (EventFiles, "close", lambda *a: True),
}


@pytest.mark.parametrize("stage", list(STAGES))
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # TensorBoard's writer thread
def test_a_full_disk_at_each_output_stage_fails_resumable_and_resume_finishes(stage, disk, reference, monkeypatch):
    owner, name, when = STAGES[stage]
    full_before(monkeypatch, owner, name, disk, when)
    with pytest.raises(Exception, match="No space left on device"):  # safetensors raises its own type
        run_in_process(smoke_config(), disk / "out")
    monkeypatch.undo()
    [run] = run_folders(disk / "out")
    status = read_status(run)
    assert status["status"] == "failed" and status["resumable"] is True, status
    assert "No space left on device" in status["error"] and "\n" not in status["error"]
    assert not (run / "model_final.safetensors").exists() or stage != "final model"

    (disk / "ballast").unlink()
    resume_in_process(run)
    assert_same_run(reference, run)  # records and weights, no round run twice
    assert [r["round"] for r in read_records(run, "eval")] == [0, 1, 2]
    assert scalars(run) == scalars(reference)
    assert not (run / RESERVE_FILE).exists()


def test_a_full_disk_when_the_status_is_written_still_completes_with_every_output(disk, reference, monkeypatch):
    """The space kept for the status (``RunFolder.reserve``) is given up for it: the run
    completes, and every output was on disk before it said so."""
    full_before(monkeypatch, RunFolder, "set_status", disk, lambda _self, status, *a, **k: status == "completed")
    run = run_in_process(smoke_config(), disk / "out")
    assert read_status(run)["status"] == "completed"
    assert_same_run(reference, run)
    assert scalars(run) == scalars(reference)


def test_a_plugin_plot_that_fails_costs_its_plot_not_the_run(tmp_path, caplog, monkeypatch):
    """A diagnostic's ``plot`` that raises, or that writes a file no reader can open, is
    skipped with a warning naming the plug-in's file:line; the run completes and its
    folder lists what was skipped (the page shows it)."""
    from fedmech_flwr.contracts import plugins
    from fedmech_flwr.contracts.hooks import DIAGNOSTICS
    from fedmech_flwr.artifacts.plotting import skipped_plots

    plugins.load()
    diagnostic = DIAGNOSTICS.get("weight_divergence").factory

    def raising(records, plots, class_names):
        raise RuntimeError("boom in plot")

    monkeypatch.setattr(diagnostic, "plot", staticmethod(raising))
    with caplog.at_level(logging.WARNING):
        run = run_in_process(smoke_config(), tmp_path / "raising")
    assert read_status(run)["status"] == "completed"
    [skipped] = skipped_plots(run)
    assert skipped["diagnostic"] == "weight_divergence" and "RuntimeError: boom in plot" in skipped["reason"]
    assert f"{Path(__file__).name}:" in skipped["where"]  # this file, where the plug-in's plot raised
    assert any("were not drawn" in r.getMessage() and "boom in plot" in r.getMessage() for r in caplog.records)
    from fedmech_flwr.tools.report import write_report

    page = write_report([run], tmp_path / "page").read_text()
    assert "Plots not drawn" in page and "boom in plot" in page

    def unreadable(records, plots, class_names):
        path = plots / "weight_divergence_broken.png"
        path.write_bytes(b"not a png")
        return [path]

    monkeypatch.setattr(diagnostic, "plot", staticmethod(unreadable))
    run = run_in_process(smoke_config(), tmp_path / "unreadable")
    assert read_status(run)["status"] == "completed"
    [skipped] = skipped_plots(run)
    assert "not a readable image" in skipped["reason"]
    assert not (run / "plots" / "weight_divergence_broken.png").exists()
    assert json.loads((run / "plots" / "skipped.json").read_text()) == [skipped]


def test_an_io_error_is_one_line_never_a_traceback(disk, reference, capsys):
    """A full disk under ``fedmech report --out``: exit 1, one line naming the reason and
    what to do."""
    from fedmech_flwr.tools.cli import main

    fill(disk)
    assert main(["report", str(reference), "--out", str(disk / "page")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "No space left on device" in err[0], err
    assert "free space" in err[0] and "`fedmech report` again" in err[0]

"""``make demo``'s job, pinned: experiments/demo.yaml at its ``tiny`` preset (real
Fashion-MNIST, real ``fedmech sweep``) produces every record the verdict reads, prints the
verdict and names the sweep's page last; the page opens offline in headless Chromium with
the headline figure and the verdict first."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import CHROMIUM, REPO, browser_page, once_per_session
from fedmech_flwr.artifacts.folder import read_records
from fedmech_flwr.datasets.data import DEBIAN_FASHION_MNIST

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not DEBIAN_FASHION_MNIST.is_dir(), reason="dataset-fashion-mnist absent")]


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The demo's sweep, made once per session: its folder and its process."""
    def make(folder: Path) -> None:
        done = subprocess.run([sys.executable, "-m", "fedmech_flwr.tools.cli", "sweep", "experiments/demo.yaml",
                               "--preset", "tiny", "--out", str(folder)], cwd=REPO, capture_output=True, text=True,
                              timeout=600)
        (folder / "process.json").write_text(json.dumps([done.returncode, done.stdout, done.stderr]))

    folder = once_per_session(tmp_path_factory, "demo", make)
    returncode, stdout, stderr = json.loads((folder / "process.json").read_text())
    return folder / "demo-tiny", subprocess.CompletedProcess([], returncode, stdout, stderr)


def test_the_demo_records_what_its_verdict_reads(demo):
    folder, done = demo
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    for cell in ("a0.05_s0", "iid_s0"):
        records = read_records(folder / "runs" / cell, "diagnostic")
        [misalignment] = [r for r in records if r["name"] == "misalignment"]
        for head in ("global", "probe", "realigned"):
            assert 0.0 <= misalignment[head]["accuracy"] <= 1.0
            assert 0.0 < misalignment[head]["max_predicted_fraction"] <= 1.0  # the one-class flag's input
        [circuits] = [r for r in records if r["name"] == "circuits"]
        assert "local_to_global" in circuits["mean"]


def test_the_demo_ends_with_its_verdict_and_names_its_page_last(demo):
    folder, done = demo
    lines = done.stdout.splitlines()
    page = folder / "report" / "index.html"
    assert lines[-1] == f"page: {page}"
    verdict = json.loads((folder / "report" / "summary.json").read_text())["verdict"]
    # a line per readout, a reading per readout and the IID control's calibration, then the page
    assert len(verdict) == 7 and lines[-8:-1] == verdict
    assert verdict[0].startswith("Label skew (α=0.05) against its IID control, one seed, so no interval")
    assert [line.split()[:2] for line in verdict[1:4]] == [["global", "model"], ["linear", "probe"], ["its", "head"]]
    assert all(" skewed | " in line and line.split(" IID")[0] for line in verdict[1:4])
    assert all("one seed is not evidence" in line for line in verdict[4:6])
    assert verdict[6].startswith("  calibration (the IID control")


@pytest.mark.skipif(not CHROMIUM.exists(), reason="no /usr/bin/chromium (apt-get install chromium)")
def test_the_demo_page_opens_offline_with_the_headline_and_the_verdict_first(demo, tmp_path):
    folder, _ = demo
    errors: list[str] = []
    with browser_page() as page:
        page.on("pageerror", lambda err: errors.append(str(err)))
        page.on("request", lambda req: errors.append(req.url) if not req.url.startswith(("file:", "data:")) else None)
        page.goto((folder / "report" / "index.html").as_uri())
        page.wait_for_load_state("load")
        first = page.eval_on_selector("h2", "h => h.textContent")
        image = page.eval_on_selector("h2 + figure img", "i => i.complete ? i.naturalWidth : 0")
        verdict = page.eval_on_selector("h2 ~ ul", "u => u.textContent")
        page.screenshot(path=str(tmp_path / "demo.png"), full_page=True)  # kept in tmp_path: look at it
    assert errors == []  # nothing but the file itself and its inline images: no CDN, no network
    assert first == "Preserved or misaligned: the headline" and image > 0
    assert "linear probe on its frozen features" in verdict

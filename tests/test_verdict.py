"""The verdict a sweep prints and its page holds: a label-skewed group beside its IID
control, in at most five lines, claiming only what the intervals over seeds support."""

from __future__ import annotations

import json
import math

from test_report import IID, T2, config, write_run

from fedmech_flwr.tools.report import write_report

SKEWED_GAPS = (0.40, 0.45, 0.50)
IID_GAPS = (0.02, 0.03, 0.04)


def _verdict(root, skewed_gaps=SKEWED_GAPS, iid_gaps=IID_GAPS, collapsed=False) -> list[str]:
    """Write run folders (skewed: accuracy 0.3; IID: 0.8; probe gaps as given) and return
    the verdict of their report."""
    for seed, gap in enumerate(skewed_gaps):
        write_run(root / f"skewed_s{seed}", config(seed), accuracy=0.3, probe_gap=gap, collapsed=collapsed)
    for seed, gap in enumerate(iid_gaps):
        write_run(root / f"iid_s{seed}", config(seed, **IID), accuracy=0.8, probe_gap=gap)
    runs = sorted(p for p in root.iterdir())
    write_report(runs, root / "report")
    return json.loads((root / "report" / "summary.json").read_text())["verdict"]


def _points(values) -> str:
    mean = sum(values) / len(values)
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
    return f"{100 * mean:+.1f} ± {100 * T2 * sd / math.sqrt(len(values)):.1f} pp"


def test_the_verdict_sets_each_readout_beside_its_iid_control_with_its_interval(tmp_path):
    lines = _verdict(tmp_path)
    assert len(lines) == 5
    assert lines[0] == "Label skew (α=0.05) against its IID control, 3 seeds each, mean ± 95% interval:"
    assert lines[1].split() == ["global", "model", "30.0", "±", "0.0%", "skewed", "|", "80.0", "±", "0.0%", "IID"]
    probe = lines[2].split()
    assert probe[:6] == ["linear", "probe", "on", "its", "frozen", "features"]
    assert probe[6] == "75.0" and probe[11] == "83.0"  # 30 + 45, 80 + 3
    assert lines[4].startswith("  → the features kept what the head stopped reading: ")
    assert f"probe − global {_points(SKEWED_GAPS)} skewed vs {_points(IID_GAPS)} IID" in lines[4]
    page = (tmp_path / "report" / "index.html").read_text()
    assert "the features kept what the head stopped reading" in page


def test_overlapping_intervals_are_no_evidence(tmp_path):
    lines = _verdict(tmp_path, skewed_gaps=(0.0, 0.30, 0.05), iid_gaps=(0.02, 0.03, 0.04))
    assert lines[4].startswith("  → no evidence at n=3 that skew cost the head more than the features")


def test_one_seed_is_said_to_be_one_and_a_one_class_model_is_named(tmp_path):
    lines = _verdict(tmp_path, skewed_gaps=(0.4,), iid_gaps=(0.02,), collapsed=True)
    assert "one seed, so no interval" in lines[0]
    assert "⚑ skewed: one class in 1/1 seeds (it predicts one class for over 90% of the test images)" in lines[1]
    assert "one seed is not evidence" in lines[4] and "widened" in lines[4] and "by 38.0 pp" in lines[4]
    assert "kept what the head" not in lines[4]


def test_runs_without_an_iid_control_get_no_verdict(tmp_path):
    for seed in (0, 1):
        write_run(tmp_path / f"skewed_s{seed}", config(seed), accuracy=0.3)
    write_report(sorted(tmp_path.iterdir()), tmp_path / "report")
    assert json.loads((tmp_path / "report" / "summary.json").read_text())["verdict"] == []

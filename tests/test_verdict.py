"""The verdict a sweep prints and its page holds: a label-skewed group beside its IID
control, a line per readout and a reading per readout, claiming a change only where the
Welch interval of the skewed − IID difference excludes 0."""

from __future__ import annotations

import json
import math

from scipy.stats import t as student_t

from test_report import IID, T2, config, write_run

from fedmech_flwr.tools.report import write_report

SKEWED_GAPS = (0.40, 0.45, 0.50)
IID_GAPS = (0.02, 0.03, 0.04)


def _verdict(root, skewed_gaps=SKEWED_GAPS, iid_gaps=IID_GAPS, collapsed=False, skewed_accuracy=0.3) -> list[str]:
    """Write run folders (skewed: accuracy ``skewed_accuracy``; IID: 0.8; probe gaps as
    given) and return the verdict of their report."""
    for seed, gap in enumerate(skewed_gaps):
        write_run(root / f"skewed_s{seed}", config(seed), accuracy=skewed_accuracy, probe_gap=gap, collapsed=collapsed)
    for seed, gap in enumerate(iid_gaps):
        write_run(root / f"iid_s{seed}", config(seed, **IID), accuracy=0.8, probe_gap=gap)
    runs = sorted(p for p in root.iterdir())
    write_report(runs, root / "report")
    return json.loads((root / "report" / "summary.json").read_text())["verdict"]


def _points(values) -> str:
    mean = sum(values) / len(values)
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
    return f"{100 * mean:+.1f} ± {100 * T2 * sd / math.sqrt(len(values)):.1f} pp"


def _welch(a, b) -> str:
    """``6.0 ± 4.5 pp``: mean(a) − mean(b) in points, unsigned, with its Welch 95% half-width."""
    va, vb = (sum((v - sum(x) / len(x)) ** 2 for v in x) / (len(x) - 1) / len(x) for x in (a, b))
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    half = student_t.ppf(0.975, df) * math.sqrt(va + vb)
    return f"{100 * abs(sum(a) / len(a) - sum(b) / len(b)):.1f} ± {100 * half:.1f} pp"


def test_the_verdict_sets_each_readout_beside_its_iid_control_with_its_interval(tmp_path):
    lines = _verdict(tmp_path)
    assert len(lines) == 7  # no pooled-data probe in these runs: no line for it
    assert lines[0] == ("Label skew (α=0.05) against its IID control, 3 seeds each, mean ± 95% interval; a change is "
                        "claimed only where the Welch 95% interval of the skewed − IID difference excludes 0:")
    assert lines[1].split() == ["global", "model", "30.0", "±", "0.0%", "skewed", "|", "80.0", "±", "0.0%", "IID"]
    probe = lines[2].split()
    assert probe[:6] == ["linear", "probe", "on", "its", "frozen", "features"]
    assert probe[6] == "75.0" and probe[11] == "83.0"  # 30 + 45, 80 + 3
    probes_skewed, probes_iid = [0.3 + g for g in SKEWED_GAPS], [0.8 + g for g in IID_GAPS]
    assert lines[4] == (
        "  → probe: the features kept what the head stopped reading: skew cost the head 50.0 ± 0.0 pp and moved it "
        f"-{_welch(probes_skewed, probes_iid)}, an interval that holds 0; probe − global {_points(SKEWED_GAPS)} "
        f"skewed vs {_points(IID_GAPS)} IID, widened by {_welch(SKEWED_GAPS, IID_GAPS)}.")
    assert lines[5].startswith("  → realigned (val-selected): ")
    assert lines[6].startswith("  calibration (the IID control, where a readout that sees what the features carry "
                               "reaches the model's own accuracy): ")
    assert f"probe {_points(IID_GAPS)}, reaches it" in lines[6]
    assert "intervals apart" not in " ".join(lines)
    page = (tmp_path / "report" / "index.html").read_text()
    assert "the features kept what the head stopped reading" in page


def test_a_difference_whose_welch_interval_excludes_0_is_claimed_by_that_criterion_not_as_intervals_apart(tmp_path):
    """The issue's case: gaps of 8, 10, 12 pp against 2, 4, 6 pp. Their own 95% intervals,
    [5.0, 15.0] and [-1.0, 9.0], overlap; the Welch interval of the difference, 6.0 ± 4.5,
    excludes 0. The verdict names that criterion and never calls the intervals apart."""
    skewed_gaps, iid_gaps = (0.08, 0.10, 0.12), (0.02, 0.04, 0.06)
    lines = _verdict(tmp_path, skewed_gaps, iid_gaps, skewed_accuracy=0.74)
    assert _points(skewed_gaps) == "+10.0 ± 5.0 pp" and _points(iid_gaps) == "+4.0 ± 5.0 pp"
    assert "the Welch 95% interval of the skewed − IID difference excludes 0" in lines[0]
    assert lines[4] == (
        "  → probe: the features kept what the head stopped reading: skew cost the head 6.0 ± 0.0 pp and moved it "
        "+0.0 ± 4.5 pp, an interval that holds 0; probe − global +10.0 ± 5.0 pp skewed vs +4.0 ± 5.0 pp IID, "
        "widened by 6.0 ± 4.5 pp.")
    assert "intervals apart" not in " ".join(lines)


def test_when_the_probe_itself_falls_under_skew_the_verdict_says_so_and_not_that_the_features_kept(tmp_path):
    skewed_gaps = (0.30, 0.32, 0.34)  # probe 60-64% skewed against 82-84% IID: the probe fell
    lines = _verdict(tmp_path, skewed_gaps)
    probes_skewed, probes_iid = [0.3 + g for g in skewed_gaps], [0.8 + g for g in IID_GAPS]
    assert lines[4] == (
        f"  → probe: skew cost it {_welch(probes_skewed, probes_iid)} and the head 50.0 ± 0.0 pp: "
        f"the head lost more, but what it reads of the features fell too; probe − global {_points(skewed_gaps)} skewed vs "
        f"{_points(IID_GAPS)} IID, widened by {_welch(skewed_gaps, IID_GAPS)}.")
    assert not any("kept what the head" in line for line in lines)


def test_a_probe_that_lost_more_than_the_head_is_said_to_have(tmp_path):
    skewed_gaps = (-0.10, -0.11, -0.12)  # same head as IID (80%), probe 68-70% against 82-84%
    lines = _verdict(tmp_path, skewed_gaps, skewed_accuracy=0.8)
    assert lines[4].startswith("  → probe: skew cost it ")
    assert f": it lost more than the head; probe − global {_points(skewed_gaps)} skewed" in lines[4]
    assert lines[4].endswith(f"narrowed by {_welch(skewed_gaps, IID_GAPS)}.")


def test_overlapping_intervals_are_no_evidence(tmp_path):
    lines = _verdict(tmp_path, skewed_gaps=(0.0, 0.30, 0.05), iid_gaps=(0.02, 0.03, 0.04))
    assert lines[4].startswith("  → probe: no evidence at n=3 that skew cost the head more than it: ")
    assert "whose interval holds 0" in lines[4]


def test_one_seed_is_said_to_be_one_and_a_one_class_model_is_named(tmp_path):
    lines = _verdict(tmp_path, skewed_gaps=(0.4,), iid_gaps=(0.02,), collapsed=True)
    assert "one seed, so no interval" in lines[0] and "Welch" not in lines[0]
    assert "⚑ skewed: one class in 1/1 seeds (it predicts one class for over 90% of the test images)" in lines[1]
    assert lines[4] == ("  → probe: in this one seed skew cost it 12.0 pp and the head 50.0 pp; probe − global "
                        "+40.0 pp skewed vs +2.0 pp IID, widened by 38.0 pp; one seed is not evidence: rerun with "
                        "--seeds 0,1,2.")
    assert "±" not in lines[4] and "kept what the head" not in lines[4]


def test_the_pooled_data_probe_gets_its_line_its_reading_and_its_calibration(tmp_path):
    """The pooled-data probe is a ``by_skew`` readout of the misalignment diagnostic: where
    the runs measured it, the verdict shows its level, judges it like the first probe and
    checks it against the IID control, where this one falls short of the head."""
    for seed in range(3):
        for name, cfg, accuracy, pooled in ((f"skewed_s{seed}", config(seed), 0.3, 0.6 + seed / 100),
                                            (f"iid_s{seed}", config(seed, **IID), 0.8, 0.7 + seed / 100)):
            metrics = write_run(tmp_path / name, cfg, accuracy=accuracy) / "metrics.jsonl"
            records = [json.loads(line) for line in metrics.read_text().splitlines()]
            for record in records:
                if record.get("name") == "misalignment":
                    record["probe_pooled"] = {"accuracy": pooled, "per_class": [pooled] * 4}
            metrics.write_text("".join(json.dumps(record) + "\n" for record in records))
    write_report(sorted(tmp_path.iterdir()), tmp_path / "report")
    lines = json.loads((tmp_path / "report" / "summary.json").read_text())["verdict"]
    assert len(lines) == 9
    assert lines[3].split()[:7] == ["linear", "probe", "on", "its", "frozen", "features,", "trained"]
    assert lines[3].split()[-9:] == ["61.0", "±", "2.5%", "skewed", "|", "71.0", "±", "2.5%", "IID"]
    assert lines[6].startswith("  → pooled-data probe: skew cost it 10.0 ± 2.3 pp and the head 50.0 ± 0.0 pp: ")
    assert "pooled-data probe -9.0 ± 2.5 pp, falls short of it: it under-reads the features" in lines[8]


def test_runs_without_an_iid_control_get_no_verdict(tmp_path):
    for seed in (0, 1):
        write_run(tmp_path / f"skewed_s{seed}", config(seed), accuracy=0.3)
    write_report(sorted(tmp_path.iterdir()), tmp_path / "report")
    assert json.loads((tmp_path / "report" / "summary.json").read_text())["verdict"] == []

"""``fedmech usae`` on saved runs, and the per-round ``usae`` diagnostic in a run."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from conftest import smoke_config
from fedmech_flwr.artifacts.folder import read_records
from fedmech_flwr.builtin.diagnostics.usae.model import load_usae
from fedmech_flwr.learning.arrays import load_arrays, save_arrays
from fedmech_flwr.tools.cli import EXIT_BAD_INPUT, build_parser, main

TINY = ["--set", "expansion=2", "--set", "k=4", "--set", "epochs=2"]
NO_CONTROLS = ["--no-null-control", "--no-seed-control"]
TINY_YAML = "{expansion: 2, k: 4, epochs: 2, batch_size: 256}"


@pytest.fixture(scope="module")
def usae_run(tmp_path_factory) -> Path:
    """A second smoke run (other seed, an audit set) with the usae diagnostic every round."""
    from fedmech_flwr.app.inprocess import run_in_process

    torch.set_num_threads(1)
    cfg = smoke_config([
        "seed=1", "data.audit_per_class=10",
        f"diagnostics=[{{name: usae, layer: conv2, max_images: 100, usae: {TINY_YAML}}}]",
    ])
    return run_in_process(cfg, tmp_path_factory.mktemp("usae-run"))


def test_usae_is_a_registered_subcommand():
    assert "usae" in build_parser()._subparsers._group_actions[0].choices


def test_offline_usae_writes_every_file(smoke_run, usae_run, tmp_path, capsys):
    out = tmp_path / "usae"
    assert main(["usae", str(smoke_run), f"{usae_run}@1", "--layer", "conv2", "--out", str(out), *TINY]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert Path(printed[-1]) == out.resolve()
    assert "(fires once, the project's reading of the paper)" in printed[0] and "(calibrated: unique needs >= " in printed[0]
    assert printed[1].startswith(f"null control, {smoke_run.name} against itself: cross R^2 ")
    assert printed[2].startswith("seed control, the comparison with USAE seed 1: cross R^2 ")
    for name in ("usae.safetensors", "metrics.json", "config.json", "plots/usae_r2.png",
                 "plots/usae_activity.png", "plots/usae_stitching.png"):
        assert (out / name).is_file(), name
    assert (out / "plots" / "usae_r2.png").read_bytes()[:4] == b"\x89PNG"
    metrics = json.loads((out / "metrics.json").read_text())
    r2 = np.array(metrics["r2"])
    assert r2.shape == (2, 2) and np.isfinite(r2).all()
    assert metrics["models"] == [smoke_run.name, f"{usae_run.name}@1"]
    for key in ("fires_once", "thresholded", "calibrated"):
        o = metrics["overlap"][key]
        assert o["shared"] + sum(o["unique"].values()) <= o["alive"] <= metrics["dict_size"] == 16
        assert 0.0 <= o["overlap"] <= 1.0
    assert metrics["overlap"]["thresholded"]["threshold"] == 0.01
    assert metrics["overlap"]["calibrated"]["min_count"] == 10  # 2 models x 16 concepts at alpha 0.05
    null = metrics["null_control"]
    assert metrics["fit"] is True and null["fit"] is True
    assert null["models"] == [f"{smoke_run.name} (copy 0)", f"{smoke_run.name} (copy 1)"]
    assert set(null["overlap"]) == {"fires_once", "thresholded", "calibrated"}
    # the cpu preset's symmetric schedule: identical models get identical encoders
    assert all(null["overlap"][key]["overlap"] == 1.0 for key in ("fires_once", "calibrated"))
    again = metrics["seed_control"]
    assert again["seed"] == 1 and set(again["overlap"]) == {"fires_once", "thresholded", "calibrated"}
    assert len(metrics["stitching"]) == 2 * 2 * 3  # (i -> j incl. i -> i) x {all, shared, unique}
    row = metrics["stitching"][0]
    assert 0.0 <= row["accuracy"] <= 1.0 and set(row) >= {"percent_of_own", "own_accuracy", "concepts_kept"}
    # the first source has no audit set: the first training images, flagged as seen in training
    assert metrics["data"]["split"] == "train_head" and "trained on" in metrics["data"]["note"]
    config = json.loads((out / "config.json").read_text())
    assert config["usae"]["k"] == 4 and config["layer"] == "conv2" and config["data"]["split"] == "train_head"
    assert [s["spec"] for s in config["sources"]] == [str(smoke_run), f"{usae_run}@1"]
    assert config["sources"][1]["weights"].endswith("checkpoints/round_001.safetensors")


def test_audit_split_and_test_split_are_recorded(smoke_run, usae_run, tmp_path):
    out = tmp_path / "audit"
    assert main(["usae", str(usae_run), str(smoke_run), "--layer", "conv1", "--out", str(out), *NO_CONTROLS,
                 *TINY]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    data = metrics["data"]
    assert "null_control" not in metrics
    assert data["split"] == "audit" and data["num_images"] == 40
    assert f"NOT held out from {smoke_run.name}" in data["note"]
    out = tmp_path / "test"
    assert main(["usae", str(usae_run), str(smoke_run), "--layer", "conv1", "--out", str(out),
                 "--split", "test", "--max-images", "30", *NO_CONTROLS, *TINY]) == 0
    data = json.loads((out / "metrics.json").read_text())["data"]
    assert data == {"split": "test", "note": "the test set (the paper's choice)", "num_images": 30}


def test_two_identical_sources_give_a_symmetric_r2_matrix(smoke_run, tmp_path):
    """Also issue 12's smoke run against itself: 5 passes over its 10,800 conv2 tokens are
    55 steps (self R^2 0.17, not fit); ``min_steps`` makes them 1,000 (0.88; > 0.8 asserted)."""
    out = tmp_path / "same"
    config = smoke_run / "config.yaml"
    weights = smoke_run / "model_final.safetensors"
    assert main(["usae", str(smoke_run), f"{config}:{weights}", "--layer", "conv2", "--out", str(out),
                 "--set", "expansion=2", "--set", "k=4", "--set", "epochs=5", *NO_CONTROLS]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    r2 = np.array(metrics["r2"])
    assert metrics["fit"] is True and np.diag(r2).min() > 0.8 and metrics["train_history"]["steps"] >= 1000
    assert np.abs(r2 - r2.T).max() < 0.05
    assert np.abs(r2 - r2.mean()).max() < 0.05  # cross = self: the models are one model
    assert metrics["overlap"]["fires_once"]["overlap"] == 1.0
    assert metrics["overlap"]["calibrated"]["overlap"] >= 0.99


def test_an_under_trained_usae_is_flagged_in_metrics_json(smoke_run, tmp_path, caplog):
    out = tmp_path / "quick"
    with caplog.at_level(logging.WARNING):
        assert main(["usae", str(smoke_run), str(smoke_run), "--layer", "conv2", "--out", str(out), *TINY,
                     "--set", "min_steps=0", *NO_CONTROLS]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["fit"] is False and min(metrics["r2"][0][0], metrics["r2"][1][1]) < 0.5
    assert "USAE at conv2 is not fit: self-reconstruction R^2" in caplog.text


def test_missing_layer_exits_2_naming_the_valid_layers(smoke_run, usae_run, tmp_path, capsys):
    assert main(["usae", str(smoke_run), str(usae_run), "--layer", "conv9", "--out", str(tmp_path / "x"),
                 *TINY]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "model 0 has no gated layer 'conv9'; its gated layers are: conv1, conv2" in err
    assert not (tmp_path / "x").exists()


def test_k_larger_than_the_dictionary_exits_2(smoke_run, usae_run, tmp_path, capsys):
    assert main(["usae", str(smoke_run), str(usae_run), "--layer", "conv2", "--out", str(tmp_path / "x"),
                 "--set", "expansion=2", "--set", "k=100"]) == EXIT_BAD_INPUT
    assert "k=100 exceeds the dictionary size 16" in capsys.readouterr().err


def test_no_images_other_datasets_and_bad_sources_exit_2(smoke_run, usae_run, tmp_path, capsys):
    args = ["--layer", "conv2", "--out", str(tmp_path / "x"), *TINY]
    assert main(["usae", str(smoke_run), str(usae_run), "--max-images", "0", *args]) == EXIT_BAD_INPUT
    assert "--max-images must be >= 1" in capsys.readouterr().err
    other = yaml.safe_load((smoke_run / "config.yaml").read_text())
    other["data"]["dataset"]["num_train"] = 200
    (tmp_path / "other.yaml").write_text(yaml.safe_dump(other))
    other_source = f"{tmp_path / 'other.yaml'}:{smoke_run / 'model_final.safetensors'}"
    assert main(["usae", str(smoke_run), other_source, *args]) == EXIT_BAD_INPUT
    assert "all sources must share the dataset" in capsys.readouterr().err
    assert main(["usae", str(smoke_run), f"{smoke_run}@7", *args]) == EXIT_BAD_INPUT
    assert "round_007.safetensors" in capsys.readouterr().err
    assert main(["usae", str(smoke_run), *args]) == EXIT_BAD_INPUT
    assert "at least 2 sources" in capsys.readouterr().err


def test_per_round_diagnostic_records_metrics_every_round(usae_run, tmp_path):
    records = [r for r in read_records(usae_run, "diagnostic") if r["name"] == "usae"]
    assert [r["round"] for r in records] == [1, 2]
    for rec in records:
        assert rec["models"] == ["global", "client 0", "client 1", "client 2"]
        assert np.array(rec["r2"]).shape == (4, 4)
        assert rec["data"] == {"split": "audit", "num_images": 40}
        assert set(rec["overlap"]) == {"fires_once", "thresholded", "calibrated"}
        assert len(rec["stitching"]) == 4 * 4 * 3
        assert rec["fit"] is True  # 2 passes over 1,440 tokens, extended to 1,000 steps
        assert "activity" not in rec
        arrays = load_arrays(usae_run / "diagnostics" / "usae" / f"round_{rec['round']:03d}.safetensors")
        assert arrays["activity"].shape == (4, 16) and arrays["usae/sites.0.decoder"].shape == (16, 8)
        usae = {name.removeprefix("usae/"): a for name, a in arrays.items() if name.startswith("usae/")}
        save_arrays(tmp_path / "usae.safetensors", usae)
        loaded = load_usae(tmp_path / "usae.safetensors")
        assert (loaded.widths, loaded.dict_size, loaded.k) == ([8] * 4, 16, 4)
    assert (usae_run / "plots" / "usae_overlap.png").is_file()
    assert (usae_run / "plots" / "usae_r2.png").is_file()


def test_diagnostic_against_a_reference_model(smoke_run, usae_run):
    from fedmech_flwr.builtin.diagnostics.usae.diagnostic import Usae, UsaeDiagnosticConfig
    from fedmech_flwr.learning.arrays import load_model_arrays
    from fedmech_flwr.spec.experiment import load_data, new_model
    from fedmech_flwr.contracts.hooks import RoundState
    from fedmech_flwr.foundation.typed import parse_dataclass

    cfg = smoke_config()
    bundle = load_data(cfg)

    def build(arrays):
        model = new_model(cfg, bundle)
        load_model_arrays(model, arrays)
        return model.eval()

    params = parse_dataclass(UsaeDiagnosticConfig, {"layer": "conv1", "compare": "reference",
                                                    "reference": str(smoke_run), "max_images": 50,
                                                    "usae": yaml.safe_load(TINY_YAML)}, "test")
    arrays = load_arrays(usae_run / "model_final.safetensors")
    state = RoundState(3, arrays, arrays, {}, {"test": (bundle.x_test, bundle.y_test)}, 4, build, torch.device("cpu"), 0)
    result = Usae(params).server_side(state)
    assert result.metrics["models"] == ["global", f"reference {smoke_run.name}"]
    assert result.metrics["data"] == {"split": "test", "num_images": 50}
    assert np.array(result.metrics["r2"]).shape == (2, 2)


def test_analyse_streams_tokens_past_the_memory_limit(smoke_run, usae_run):
    from fedmech_flwr.builtin.diagnostics.usae.analysis import analyse
    from fedmech_flwr.builtin.diagnostics.usae.model import USAEConfig
    from fedmech_flwr.builtin.diagnostics.usae.sources import load_source_model, parse_source
    from fedmech_flwr.spec.experiment import load_data

    models = [load_source_model(parse_source(str(run))) for run in (smoke_run, usae_run)]
    bundle = load_data(smoke_config())
    cfg = USAEConfig(expansion=2, k=4, epochs=1, batch_size=256)
    _, metrics = analyse(models, ["a", "b"], "conv2", bundle.x_test[:40], bundle.y_test[:40], cfg,
                         memory_limit_bytes=0)
    assert metrics["token_source"] == "streaming" and metrics["num_tokens"] == 40 * 6 * 6
    assert np.array(metrics["r2"]).shape == (2, 2) and set(metrics["l0"]) == {"a", "b"}

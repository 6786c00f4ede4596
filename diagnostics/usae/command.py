"""``fedmech usae``: one USAE over saved models, offline.

    fedmech usae SOURCE SOURCE [...] --layer conv3 [--out DIR] [--split audit|test]
                 [--preset cpu|paper] [--set key=value ...] [--max-images N] [--no-null-control]
                 [--no-seed-control]

A SOURCE is a run folder (its config.yaml and model_final.safetensors), ``RUN_DIR@N``
(its checkpoint of round N) or ``CONFIG.yaml:WEIGHTS.safetensors``. All sources must use
the same dataset. Images (``--split``):

- ``audit`` (default, a held-out split): the first source's audit set if it has one
  (``data.audit_per_class`` > 0; held out from that run's clients), else the first N
  training images, which some client of each run saw in training (recorded as
  ``train_head`` in the metrics, with that caveat);
- ``test``: the first N test images (the paper's choice).

Next to the comparison it runs two controls, so that its shared fraction is read against
what chance gives:

- a null control (unless ``--no-null-control``): the same analysis of the first source
  against itself, what identical models give (``metrics["null_control"]``; every concept
  shared under the symmetric schedule, by construction; under the paper's round robin
  what the schedule alone makes "unique");
- a seed control (unless ``--no-seed-control``): the comparison again with the USAE
  trained from the next seed (``metrics["seed_control"]``): how far the overlap moves
  with the dictionary's own training noise.

Writes ``<out>/usae.safetensors``, ``metrics.json``, ``config.json`` and ``plots/*.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
from pathlib import Path

import numpy as np

from fedmech_flwr.api import ConfigError
from fedmech_flwr.api._builtin import (
    apply_overrides,
    audit_indices,
    load_data,
    parse_dataclass,
    resolve_device,
    to_plain,
    write_text_atomic,
)
from fedmech_flwr.api.command import COMMANDS, Command, Help

from .analysis import PRESETS, analyse, overlap_summary, plot_usae
from .model import USAEConfig, save_usae
from .sources import Source, load_source_model, parse_source, unique_names

TRAIN_HEAD_NOTE = ("no audit set (data.audit_per_class = 0): the first N training images, "
                   "which clients of these runs trained on")


def usae_config(preset: str, overrides: list[str]) -> USAEConfig:
    """The preset's USAEConfig with ``key=value`` overrides (values parsed as YAML)."""
    return parse_dataclass(PRESETS[preset], apply_overrides({}, overrides), "--set")


def select_images(sources: list[Source], split: str, max_images: int):
    """(x, y, split record) from the first source's dataset."""
    cfg = sources[0].cfg
    bundle = load_data(cfg)
    if split == "test":
        x, y = bundle.x_test[:max_images], bundle.y_test[:max_images]
        record = {"split": "test", "note": "the test set (the paper's choice)"}
    else:
        audit = audit_indices(cfg, bundle)
        if len(audit):
            picked = audit[:max_images]
            x, y = bundle.x_train[picked], bundle.y_train[picked]
            record = {"split": "audit", "note": f"the audit set of {sources[0].name}, held out from its clients"}
            others = [s.name for s in sources[1:]
                      if not np.array_equal(audit_indices(s.cfg, bundle), audit)]
            if others:
                record["note"] += f"; NOT held out from {', '.join(others)} (a different or no audit set)"
        else:
            x, y = bundle.x_train[:max_images], bundle.y_train[:max_images]
            record = {"split": "train_head", "note": TRAIN_HEAD_NOTE}
    record["num_images"] = len(x)
    return x, y, record


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("sources", nargs="+", metavar="SOURCE",
                   help="RUN_DIR, RUN_DIR@ROUND or CONFIG.yaml:WEIGHTS.safetensors (at least 2)")
    p.add_argument("--layer", required=True, help="gated layer name, e.g. conv3")
    p.add_argument("--out", help="output folder (default: ./usae-<UTC timestamp>)")
    p.add_argument("--split", choices=("audit", "test"), default="audit",
                   help="audit: the first source's audit set, or if it has none the first N training images "
                        "(seen in training by clients); test: the test set (the paper's choice)")
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu",
                   help="cpu: expansion 4, k 16, 10 epochs, every model encoding every batch (symmetric); "
                        "paper: expansion 8, k 48, 100 epochs, batch 1024, one model per step (round robin); "
                        "both take at least min_steps=1000 steps")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a USAEConfig field, e.g. --set k=8 (repeatable)")
    p.add_argument("--max-images", type=int, default=2000, help="images taken from the split (default 2000)")
    p.add_argument("--threshold", type=float, default=0.01,
                   help="firing frequency above which a concept counts as active (besides > 0)")
    p.add_argument("--null-control", action=argparse.BooleanOptionalAction, default=True,
                   help="also analyse the first source against itself, the baseline of the shared fraction "
                        "(default: on; doubles the time)")
    p.add_argument("--seed-control", action=argparse.BooleanOptionalAction, default=True,
                   help="also train the comparison's USAE from the next seed, the spread of the shared fraction "
                        "that the dictionary's training gives (default: on; adds the comparison's time)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")


def run(args: argparse.Namespace) -> int:
    if len(args.sources) < 2:
        raise ConfigError(f"give at least 2 sources, got {len(args.sources)}", "usae sources")
    if args.max_images < 1:
        raise ConfigError(f"--max-images must be >= 1, got {args.max_images}", "usae --max-images")
    cfg = usae_config(args.preset, args.set)
    sources = [parse_source(spec) for spec in args.sources]
    first = to_plain(sources[0].cfg.data.dataset)
    for s in sources[1:]:
        if to_plain(s.cfg.data.dataset) != first:
            raise ConfigError(
                f"{s.spec} uses dataset {to_plain(s.cfg.data.dataset)}, but {sources[0].spec} uses {first}; "
                "all sources must share the dataset", "usae sources")
    device = resolve_device(args.device)
    models = [load_source_model(s, device) for s in sources]
    names = unique_names(sources)
    x, y, split = select_images(sources, args.split, args.max_images)
    usae, metrics = analyse(models, names, args.layer, x, y, cfg, device, args.threshold)
    metrics["data"] = split
    if args.null_control:
        twins = [f"{names[0]} (copy {i})" for i in range(len(models))]
        _, null = analyse([models[0]] * len(models), twins, args.layer, x, y, cfg, device, args.threshold)
        metrics["null_control"] = {"models": twins, "r2_cross_mean": null["r2_cross_mean"], "overlap": null["overlap"],
                                   "fit": null["fit"],
                                   "note": "the first source against itself: what identical models give"}
    if args.seed_control:
        reseeded = dataclasses.replace(cfg, seed=cfg.seed + 1)
        _, again = analyse(models, names, args.layer, x, y, reseeded, device, args.threshold)
        metrics["seed_control"] = {"seed": reseeded.seed, "r2_cross_mean": again["r2_cross_mean"],
                                   "overlap": again["overlap"], "fit": again["fit"],
                                   "note": "the comparison with the USAE trained from another seed: how far the "
                                           "overlap moves with the dictionary's own training"}

    out = Path(args.out or f"usae-{dt.datetime.now(dt.timezone.utc).strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    save_usae(out / "usae.safetensors", usae)
    write_text_atomic(out / "metrics.json", json.dumps(metrics, indent=1))
    write_text_atomic(out / "config.json", json.dumps({
        "usae": dataclasses.asdict(cfg), "preset": args.preset, "layer": args.layer, "data": split,
        "threshold": args.threshold, "max_images": args.max_images, "null_control": args.null_control,
        "seed_control": args.seed_control,
        "device": str(device),
        "sources": [{"spec": s.spec, "name": n, "config": str(s.config_path.resolve()),
                     "weights": str(s.weights_path.resolve())} for s, n in zip(sources, names)],
    }, indent=1))
    plot_usae(metrics, out / "plots")
    print(f"USAE over {len(models)} models at {args.layer} on {split['num_images']} images ({split['split']}): "
          f"cross R^2 {metrics['r2_cross_mean']:.3f}, {overlap_summary(metrics['overlap'])}")
    if args.null_control:
        null = metrics["null_control"]
        print(f"null control, {names[0]} against itself: cross R^2 {null['r2_cross_mean']:.3f}, "
              f"{overlap_summary(null['overlap'])}")
    if args.seed_control:
        again = metrics["seed_control"]
        print(f"seed control, the comparison with USAE seed {again['seed']}: cross R^2 {again['r2_cross_mean']:.3f}, "
              f"{overlap_summary(again['overlap'])}")
    print(out.resolve())
    return 0


COMMANDS.register("usae")(Command(Help(
    "train a universal sparse autoencoder over saved models and measure it",
    "Train one universal sparse autoencoder (USAE) on the activations of a layer of two or more saved models "
    "(run folders, a round's checkpoint, or a config with weights) on the same images, and measure which "
    "concepts the models share and which are unique, next to a null control (the first model against itself) "
    "and a seed control (the USAE trained again from another seed). Writes the USAE, metrics.json, config.json "
    "and plots.",
    ("0  written", "2  bad input (sources, layer, sizes), refused before training"),
    ("fedmech usae RUN_IID RUN_SKEWED --layer conv3 --out usae/",
     "fedmech usae RUN_DIR@5 RUN_DIR@20 --layer conv2 --preset paper --split test")), add_arguments, run))

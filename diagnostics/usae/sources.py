"""Models named on the command line: a run folder, ``RUN_DIR@N`` (its checkpoint of round
N) or ``CONFIG.yaml:WEIGHTS.safetensors``; each rebuilt from its experiment config."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from fedmech_flwr.api import ConfigError, ExperimentConfig
from fedmech_flwr.api._builtin import (
    CHECKPOINT_DIR,
    CONFIG_FILE,
    FINAL_MODEL_FILE,
    load_arrays,
    load_data,
    load_experiment,
    model_builder,
    round_file,
)
from fedmech_flwr.api.model import FedMechModel


@dataclass
class Source:
    spec: str
    """As given on the command line."""
    name: str
    """Short label for plots and metrics."""
    config_path: Path
    weights_path: Path
    cfg: ExperimentConfig


def parse_source(spec: str) -> Source:
    """Resolve one SOURCE (files must exist; the config is validated)."""
    if ":" in spec and Path(spec.rsplit(":", 1)[0]).suffix in (".yaml", ".yml"):
        config_text, weights_text = spec.rsplit(":", 1)
        config_path, weights_path = Path(config_text), Path(weights_text)
        name = weights_path.stem
    else:
        run_text, _, round_text = spec.partition("@")
        run_dir = Path(run_text)
        if not run_dir.is_dir():
            raise ConfigError(
                f"{spec!r} is neither a run folder nor CONFIG.yaml:WEIGHTS.safetensors", "usae sources"
            )
        config_path = run_dir / CONFIG_FILE
        if round_text:
            if not round_text.isdigit():
                raise ConfigError(f"expected RUN_DIR@ROUND with an integer round, got {spec!r}", "usae sources")
            weights_path = run_dir / CHECKPOINT_DIR / round_file(int(round_text))
        else:
            weights_path = run_dir / FINAL_MODEL_FILE
        name = run_dir.resolve().name + (f"@{int(round_text)}" if round_text else "")
    for path in (config_path, weights_path):
        if not path.is_file():
            raise FileNotFoundError(f"{spec}: no file {path}")
    return Source(spec, name, config_path, weights_path, load_experiment(config_path))


def load_source_model(source: Source, device: torch.device | str = "cpu") -> FedMechModel:
    """The source's model (eval mode) with its weights."""
    build = model_builder(source.cfg, load_data(source.cfg), device)
    arrays = load_arrays(source.weights_path)
    try:
        return build(arrays)
    except ValueError as err:
        raise ConfigError(f"{source.weights_path} does not fit the model of {source.config_path}: {err}",
                          "usae sources") from err


def unique_names(sources: list[Source]) -> list[str]:
    """Source names, numbered where two would be equal."""
    names = [s.name for s in sources]
    return [f"{n} ({i})" if names.count(n) > 1 else n for i, n in enumerate(names)]

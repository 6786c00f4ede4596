"""A run's TensorBoard event files (``<run>/tensorboard/``), written from its declared outputs.

Each round, every declared metric (``fedmech_flwr.contracts.outputs``) that the round's records
hold, and every one a plug-in records without declaring it (``outputs.undeclared``),
becomes a scalar tagged ``RECORD/KEY`` (as a reader reads it: % and pp x 100);
per-class values become one scalar per class under ``RECORD/KEY per class/CLASS``; and,
since TensorBoard draws no flags, the flagged values of the round are listed in the text
entry ``flags`` at that step. The run's config is the text entry ``config``; its plots
become images at the end. ``tensorboard --logdir SWEEP_FOLDER`` shows every cell side by
side. The config key ``tensorboard: false`` turns the files off.
"""

from __future__ import annotations

import math
import shutil
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib.image

from fedmech_flwr.contracts.outputs import declared, latest, per_class_values

TENSORBOARD_DIR = "tensorboard"


class EventFiles:
    """The event files of one run folder, written whole: a resumed run replaces those of
    its earlier launches (which a kill or a full disk may have torn, and which hold the
    rounds the resume rewound) by the ``records`` it kept, then goes on."""

    def __init__(self, run_dir: Path, config_yaml: str, class_names: Sequence[str],
                 records: Sequence[dict[str, Any]] = ()) -> None:
        from torch.utils.tensorboard import SummaryWriter  # imported only by runs that write them

        shutil.rmtree(run_dir / TENSORBOARD_DIR, ignore_errors=True)
        self.writer = SummaryWriter(str(run_dir / TENSORBOARD_DIR))
        self.class_names = list(class_names)
        self.writer.add_text("config", "    " + config_yaml.replace("\n", "\n    "), 0)  # markdown: a code block
        by_round = defaultdict(list)
        for record in records:
            by_round[record["round"]].append(record)
        for server_round, kept in sorted(by_round.items()):
            self.round(server_round, kept)

    def round(self, server_round: int, records: list[dict[str, Any]]) -> None:
        """The declared metrics of the records of round ``server_round`` (``RunFolder.recent``)."""
        flags = []
        for key, metric in declared(records).items():  # with what plug-ins record undeclared
            found = latest(metric, records)
            if found is None:
                continue
            record, value, flag = found
            tag = key.replace(".", "/", 1)
            if isinstance(value, float):
                self.writer.add_scalar(tag, metric.display(value), server_round)
            for name, class_value in zip(self.class_names, per_class_values(metric, record) or []):
                if math.isfinite(class_value):
                    self.writer.add_scalar(f"{tag} per class/{name}", metric.display(class_value), server_round)
            if flag:
                flags.append(f"{metric.label}: ⚑ {flag}")
        if flags:
            self.writer.add_text("flags", "; ".join(flags), server_round)
        self.writer.flush()

    def close(self, plots: Sequence[Path]) -> None:
        """Add the run's plots as images, then close the files."""
        for path in plots:
            image = matplotlib.image.imread(path)
            self.writer.add_image(f"plots/{path.stem}", image[..., :3], dataformats="HWC")
        self.writer.close()

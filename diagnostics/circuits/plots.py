"""The circuits diagnostic's plots, drawn from its records alone (``Circuits.plot``); the
figure helpers, and matplotlib with them, load only when one is drawn, never in a ClientApp."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .metrics import IOU_KEYS, empty_iou_convention

UNRECORDED = "empty vs empty: as the run's empty_iou, not recorded then (default 1.0, the paper's convention)"
"""The convention line of records written before ``empty_iou`` was recorded."""


def draw(records: list[dict[str, Any]], plots_dir: Path, class_names: Sequence[str] | None) -> list[Path]:
    """The circuits diagnostic's plots from its records: IoU over rounds, local-to-global IoU
    per class, circuit sizes and the share of empty circuits."""
    from fedmech_flwr.api._builtin import class_labels  # matplotlib: only where a plot is drawn
    from fedmech_flwr.api.diagnostic import heatmap, line_plot

    if not records:
        return []
    window = records[-1].get("moving_average", 1)
    convention = empty_iou_convention(records[-1]["empty_iou"]) if "empty_iou" in records[-1] else UNRECORDED
    lines, notes, undefined = {}, {}, []
    for key in IOU_KEYS:
        label = key.replace("_", " ")
        points = [(r["round"], r["mean"][key]) for r in records if r["mean"].get(key) is not None]
        if points:
            lines[label] = _moving_average(points, window)
            notes[label] = {r["round"]: str(r["pairs"][key]) for r in records if "pairs" in r}
        gaps = [r["round"] for r in records if r["mean"].get(key) is None and r.get("undefined", {}).get(key)]
        if gaps:
            undefined.append(f"{label} in round(s) {', '.join(map(str, gaps))}")
    out = []
    if lines:
        title = "Circuit IoU over rounds, mean over classes" + (f" (moving average of {window})" if window > 1 else "")
        footnote = f"numbers: pairs each mean covers; {convention}"
        if undefined:
            footnote += "\nundefined (every pair empty in both circuits): " + "; ".join(undefined)
        out.append(line_plot(lines, title, "IoU", plots_dir / "circuits_iou.png", (0.0, 1.05), notes, footnote))
    classes = sorted({int(c) for r in records for c in r["per_class"]})
    rounds = [r["round"] for r in records]
    cells = [[r["per_class"].get(str(c), {}) for r in records] for c in classes]
    matrix = np.array([[np.nan if v.get("local_to_global") is None else v["local_to_global"] for v in row]
                       for row in cells])
    if any("local_to_global_pairs" in v for row in cells for v in row) or np.isfinite(matrix).any():
        notes_grid = np.array([[_cell_note(v, "local_to_global") for v in row] for row in cells])
        hatch = np.array([[v.get("local_to_global_empty", 0) > 0 for v in row] for row in cells])
        footnote = f"hatched: rests on empty circuits (count shown); grey: undefined or no client\n{convention}"
        out.append(heatmap(matrix, rounds, class_labels(classes, class_names), "Local-to-global circuit IoU per class",
                           plots_dir / "circuits_local_to_global.png", notes=notes_grid, hatch=hatch,
                           footnote=footnote))
    size_lines = {
        f"{kind} circuits": [(r["round"], sum(v for v in r["sizes"][kind].values() if v is not None))
                             for r in records if any(v is not None for v in r["sizes"][kind].values())]
        for kind in ("local", "global")
    }
    size_lines = {k: v for k, v in size_lines.items() if v}
    if size_lines:
        out.append(line_plot(size_lines, "Mean circuit size (channels over all gated layers)", "channels",
                             plots_dir / "circuits_size.png"))
    kinds = sorted({kind for r in records for kind, c in r.get("circuit_counts", {}).items() if c["circuits"]})
    if kinds:
        empty_lines = {f"{kind} circuits": [(r["round"], c["empty"] / c["circuits"]) for r in records
                                            if (c := r["circuit_counts"].get(kind, {})).get("circuits")]
                       for kind in kinds}
        empty_notes = {f"{kind} circuits": {r["round"]: f"{c['empty']}/{c['circuits']}"
                                            + (f", {c['bias_only']} bias-only" if c["empty"] else "")
                                            for r in records if (c := r["circuit_counts"].get(kind, {})).get("circuits")}
                       for kind in kinds}
        out.append(line_plot(empty_lines, "Empty circuits (no channel kept)", "fraction of circuits",
                             plots_dir / "circuits_empty.png", (0.0, 1.1), empty_notes,
                             "numbers: empty / all circuits; bias-only: the model predicts the class "
                             "with every gated channel closed"))
    return out


def _cell_note(v: dict[str, Any], key: str) -> str:
    """A heatmap cell's counts: undefined pairs and empty circuits, when there are any."""
    parts = []
    if v.get(f"{key}_undefined"):
        parts.append(f"{v[f'{key}_undefined']}/{v[f'{key}_undefined'] + v[f'{key}_pairs']} undef.")
    if v.get(f"{key}_empty"):
        parts.append(f"{v[f'{key}_empty']} empty")
    return "\n".join(parts)


def _moving_average(points: list[tuple[int, float]], window: int) -> list[tuple[int, float]]:
    if window <= 1:
        return points
    values = [v for _, v in points]
    return [(r, float(np.mean(values[max(0, i - window + 1) : i + 1]))) for i, (r, _) in enumerate(points)]

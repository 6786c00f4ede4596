"""Files that a kill never leaves half-written.

Every file of a run folder is written to a hidden temporary name next to it, flushed to
disk, then renamed over the target: a reader sees the old file or the new one, never a
truncated one. Leftover temporaries of a killed writer match ``TEMPORARY_GLOB``: ours
(``.tmp.<name>``) and the ``.tmpXXXXXX`` files that safetensors' own writer renames.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from fedmech_flwr.foundation.errors import RunFolderError
from fedmech_flwr.foundation.safe_text import CONTROL, printable_lines

if TYPE_CHECKING:
    from matplotlib.figure import Figure

TEMPORARY_GLOB = ".tmp*"


def write_atomic(path: str | Path, write: Callable[[Path], object]) -> Path:
    """Call ``write(temporary_path)``, fsync it, then rename it to ``path`` (the temporary
    removed where any of it raises an error).

    The temporary name keeps the suffix, so writers that infer the format from it
    (matplotlib) still work.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp.{path.name}")
    try:
        write(tmp)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except Exception:  # a full disk: the old file stays, and no temporary beside it (a kill leaves one)
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_text_atomic(path: str | Path, text: str) -> Path:
    return write_atomic(path, lambda tmp: tmp.write_text(text))


def save_figure(fig: Figure, path: str | Path) -> Path:
    """Save a matplotlib figure (format from the suffix, 120 dpi), atomically, every text
    on it ``printable_lines``: a class name or label holding ESC or BEL draws as
    ``\\x1b``, not as a missing glyph, and a label's own line breaks stay line breaks."""
    _printable_texts(fig)
    return write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=120))


def _printable_texts(fig: Figure) -> None:
    """Every title, label, legend entry and tick label of ``fig`` made ``printable_lines``; tick
    labels given as text are redrawn from their formatter, so it is mended too."""
    from matplotlib.text import Text
    from matplotlib.ticker import FixedFormatter, FuncFormatter

    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            for formatter in (axis.get_major_formatter(), axis.get_minor_formatter()):
                if isinstance(formatter, FixedFormatter):
                    formatter.seq = [printable_lines(str(label)) for label in formatter.seq]
                elif isinstance(formatter, FuncFormatter):
                    formatter.func = lambda x, pos=None, label=formatter.func: printable_lines(str(label(x, pos)))
    for text in fig.findobj(Text):
        if CONTROL.search(text.get_text().replace("\n", "")):
            text.set_text(printable_lines(text.get_text()))


def check_writable(folder: Path) -> None:
    """Refuse a folder that could not be made, or written in, here: what ``--dry-run``
    checks in place of making it."""
    existing = folder
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK):
        why = "is not a folder" if not existing.is_dir() else "is not writable (read-only, or not yours)"
        raise RunFolderError(f"cannot write in {folder}: {existing} {why}; choose another --out")

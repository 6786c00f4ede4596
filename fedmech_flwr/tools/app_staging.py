"""A copy of a Flower app's sources for ``flwr run``: from the app's own folder Flower
would walk a virtual environment of tens of thousands of files to build the bundle."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

APP_SUFFIXES = {".py", ".toml", ".md", ".yaml", ".yml", ".json", ".jsonl"}
"""What Flower puts in an app bundle (besides a root ``LICENSE``); ``stage_app`` copies these."""


def stage_app(app: Path, into: Path) -> Path:
    """Copy the files of ``app`` that Flower may bundle into ``into`` (see ``LocalFlower.stage``),
    in the layout the app installs as: a top-level folder that its ``pyproject.toml`` maps to
    another package (``[tool.setuptools.package-dir]``: ``clients`` is
    ``fedmech_flwr.builtin.clients``) goes there. The bundle's folder is first on the
    ServerApp's and ClientApps' ``sys.path``, so a top-level ``clients`` or ``strategies``
    in it would hide a user's own package of that name."""
    ignored = _gitignore(app)
    moved = _installed_at(app)
    for folder, dirs, files in os.walk(app):
        relative = Path(folder).relative_to(app)
        dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"
                   and not ignored((relative / d).as_posix() + "/")]
        parts = relative.parts
        target = into / moved[parts[0]] / Path(*parts[1:]) if parts and parts[0] in moved else into / relative
        for name in files:
            path = (relative / name).as_posix()
            if (Path(name).suffix in APP_SUFFIXES or path in ("LICENSE", ".gitignore")) and not ignored(path):
                target.mkdir(parents=True, exist_ok=True)
                shutil.copy2(Path(folder) / name, target / name)
    return into


def _installed_at(app: Path) -> dict[str, Path]:
    """Top-level folders of ``app`` that install as a package of another path, and that path
    (``clients`` -> ``fedmech_flwr/builtin/clients``), from its ``pyproject.toml``."""
    import tomllib

    try:
        mapping = tomllib.loads((app / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    except (OSError, KeyError, TypeError, tomllib.TOMLDecodeError):
        return {}
    return {folder: Path(*package.split(".")) for package, folder in mapping.items()
            if package and isinstance(folder, str) and "/" not in folder and Path(*package.split(".")) != Path(folder)}


def _gitignore(app: Path) -> Callable[[str], bool]:
    """Whether a relative path (a folder's with a trailing ``/``) is named by ``app/.gitignore``."""
    import pathspec  # Flower's own dependency for the same rules

    source = app / ".gitignore"
    spec = pathspec.GitIgnoreSpec.from_lines(source.read_text().splitlines() if source.is_file() else [])
    return spec.match_file

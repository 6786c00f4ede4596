"""The built-in plug-ins, under names no user package can shadow.

Their sources stay at the top of the repository (``clients/``, ``strategies/``,
``diagnostics/``) and are imported as ``fedmech_flwr.builtin.clients``,
``fedmech_flwr.builtin.strategies`` and ``fedmech_flwr.builtin.diagnostics``, so a user's
own ``clients`` or ``strategies`` package on ``PYTHONPATH`` (an ordinary name in a Flower
project) is never taken for them. Their folders are in ``HOME``:

- installed from a wheel: this folder (``pyproject.toml`` maps them here with
  ``[tool.setuptools.package-dir]``);
- in the repository (an editable install, a source checkout, the app bundle ``flwr run``
  builds of it): the folder above ``fedmech_flwr``.

Only those three names import here: ``__path__`` is empty, and ``_Mount``, first on
``sys.meta_path``, finds each in ``HOME``; their subpackages then import from their own
folders. Anything else of the repository's root (``fedmech_flwr.builtin.tests``, a second
``fedmech_flwr.builtin.fedmech_flwr``) is not found.
"""

import sys
from importlib.machinery import ModuleSpec, PathFinder
from pathlib import Path

PACKAGES = ("clients", "strategies", "diagnostics")
"""The built-in plug-in packages, in the order they load."""

_HERE = Path(__file__).resolve().parent
HOME = _HERE if all((_HERE / name / "__init__.py").is_file() for name in PACKAGES) else _HERE.parents[1]
"""The folder that holds the built-in packages' folders (the module docstring says which)."""

__path__: list[str] = []


class _Mount:
    """The meta path finder of ``fedmech_flwr.builtin.<one of PACKAGES>``, in ``HOME``
    (first on ``sys.meta_path``, so another checkout's editable install cannot map them)."""

    @staticmethod
    def find_spec(fullname: str, path: object = None, target: object = None) -> ModuleSpec | None:
        parent, _, name = fullname.rpartition(".")
        if parent != __name__ or name not in PACKAGES:
            return None
        if (spec := PathFinder.find_spec(fullname, [str(HOME)])) is None:
            raise ModuleNotFoundError(f"the built-in plug-in package {fullname} has no folder {HOME / name}: "
                                      "reinstall fedmech (pip install -e . in a checkout)", name=fullname)
        return spec


sys.meta_path.insert(0, _Mount)

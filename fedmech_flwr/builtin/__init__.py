"""The built-in plug-ins, under names no user package can shadow.

Their sources stay at the top of the repository (``clients/``, ``strategies/``,
``diagnostics/``) and are imported as ``fedmech_flwr.builtin.clients``,
``fedmech_flwr.builtin.strategies`` and ``fedmech_flwr.builtin.diagnostics``, so a user's
own ``clients`` or ``strategies`` package on ``PYTHONPATH`` (an ordinary name in a Flower
project) is never taken for them. Where the folders are:

- installed from a wheel: here, ``fedmech_flwr/builtin/<name>`` (``pyproject.toml`` maps
  them with ``[tool.setuptools.package-dir]``);
- in the repository (an editable install, a source checkout, the app bundle ``flwr run``
  builds of it): beside the ``fedmech_flwr`` folder.

``__path__`` points at whichever of the two holds them. ``fedmech_flwr.plugins`` imports
them (the one core module that names them) and refuses a package found anywhere else.
"""

from pathlib import Path

PACKAGES = ("clients", "strategies", "diagnostics")
"""The built-in plug-in packages, in the order they load."""


def home() -> Path:
    """The folder the built-in packages are imported from: this one where an install put
    them here, else the folder above ``fedmech_flwr`` (the repository)."""
    here = Path(__file__).resolve().parent
    return here if all((here / name / "__init__.py").is_file() for name in PACKAGES) else here.parents[1]


__path__ = [str(home())]

"""One registry type for models, datasets, partitions, clients, strategies, diagnostics.

A name maps to a factory and the typed config dataclass its parameters are validated
into. Each entry records where it comes from (``Entry.origin``); registering a name twice
is an error naming both origins; an unknown name lists the registered ones and suggests
the closest.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import inspect
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from fedmech_flwr.foundation.errors import ConfigError

F = TypeVar("F", bound=Callable[..., Any])


BUILT_IN = "built-in"
"""The source of entries registered outside ``loading``: this project's own modules."""
_sources: list[str] = []


@contextlib.contextmanager
def loading(source: str) -> Iterator[None]:
    """Entries registered inside this block were loaded by ``source`` (``Entry.source``):
    ``fedmech_flwr.contracts.plugins`` wraps each plug-in import it makes in one."""
    _sources.append(source)
    try:
        yield
    finally:
        _sources.pop()


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """``"did you mean 'x'? "`` for the known name closest to ``name``; "" if none is close."""
    close = difflib.get_close_matches(name, list(known), n=1)
    return f"did you mean '{close[0]}'? " if close else ""


@dataclass(frozen=True)
class Entry(Generic[F]):
    """A registered factory and the dataclass its parameters validate into."""

    name: str
    factory: F
    config_cls: type
    pairs_with: tuple[str, ...] = ()
    """Names in the partner registry this entry only works with (a strategy's clients,
    a client's strategies); empty: any. Checked when an experiment is validated."""
    check: Callable[..., None] | None = None
    """Optional ``check(params, cfg, data, where)``: raise a ConfigError naming ``where``
    (this entry's key, e.g. ``x.yaml: strategy``) when ``params`` cannot work in the
    experiment ``cfg`` with data shaped like ``data`` (a ``fedmech_flwr.datasets.data.DataInfo``).
    Every validation calls it (``fedmech validate``, ``fedmech run`` before it starts
    anything, each sweep cell), so a plug-in's own rules fail in seconds, not in the
    ServerApp."""
    module: str = ""
    """The module that registered it."""
    source: str = BUILT_IN
    """How that module was loaded: ``built-in``, the experiment key that listed it (``x.yaml:
    plugins[0]``), or the entry point (``entry point 'median' of my-lab 0.1``)."""
    outputs: Any = None
    """What a diagnostic or strategy records, an ``fedmech_flwr.contracts.outputs.Outputs`` (which
    reads the registries, so it is not imported here): the report, the sweep's progress
    line and the published-value checks show these."""

    @property
    def summary(self) -> str:
        """The first paragraph of the factory's docstring, else of its module's, as one line:
        what the entry is and, for a published method, its paper."""
        doc = inspect.getdoc(self.factory) if self.factory.__doc__ else None
        doc = doc or inspect.getdoc(sys.modules.get(self.module)) or ""
        return " ".join(doc.split("\n\n")[0].split())

    @property
    def defaults(self) -> dict[str, Any]:
        """The parameters' default values (those that have one), as plain data: what a
        report compares a run's parameters with to name only those set otherwise."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self.config_cls) if dataclasses.is_dataclass(self.config_cls) else ():
            if f.default is not dataclasses.MISSING:
                value = f.default
            elif f.default_factory is not dataclasses.MISSING:
                value = f.default_factory()
            else:
                continue
            out[f.name] = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
        return out

    @property
    def origin(self) -> str:
        """``module (source)``, e.g. ``fedmech_flwr.builtin.strategies.fedavg (built-in)``."""
        return f"{self.module} ({self.source})"


@dataclass(frozen=True)
class _NoParams:
    """Config for factories that take no parameters."""


class Registry(Generic[F]):
    """Maps names to factories of one kind (``kind`` names it in error messages)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, Entry[F]] = {}

    def register(
        self,
        name: str,
        config_cls: type | None = None,
        pairs_with: tuple[str, ...] = (),
        check: Callable[..., None] | None = None,
        module: str | None = None,
        outputs: Any = None,
    ) -> Callable[[F], F]:
        """Decorator: register a plug-in under ``name``, the one way every role registers
        (``@STRATEGIES.register("median")``, ``@CLIENTS.register("my_client", MyConfig)``).

        Parameters
        ----------
        name : str
            What an experiment selects it by (``strategy: {name: median}``); unique in the registry.
        config_cls : dataclass type, optional
            Its parameters, validated from the experiment (None: it takes none).
        pairs_with : tuple of str
            The partners it needs (a client's strategies, a strategy's clients), checked at
            validation.
        check : callable, optional
            ``check(params, cfg, data, where)``: rules between its parameters and the experiment
            or the data, raising a ``ConfigError`` naming ``where``; every validation runs it.
        module : str, optional
            The module recorded as the entry's (default: the one calling this).
        outputs : Outputs, optional
            The metrics it records, so that every view shows them.

        Returns
        -------
        callable
            The decorator, which registers the factory (or class) and returns it unchanged.

        Raises
        ------
        ConfigError
            When ``name`` is registered already (naming both origins).

        Examples
        --------
        >>> from fedmech_flwr.api.strategy import OFFERED_NODES_ONLY, STRATEGIES, WeightedFedAvg
        >>> @STRATEGIES.register("uniform_avg")
        ... def uniform_avg(params, ctx):
        ...     return WeightedFedAvg(weighting="uniform", **OFFERED_NODES_ONLY)
        """
        module = module or sys._getframe(1).f_globals.get("__name__", "?")  # the module body registering
        source = _sources[-1] if _sources else BUILT_IN

        def decorator(factory: F) -> F:
            if name in self._entries:
                raise ConfigError(
                    f"{self.kind} '{name}' is already registered by {self._entries[name].origin}; "
                    f"{module} ({source}) registers it again: rename one of them"
                )
            self._entries[name] = Entry(name, factory, config_cls or _NoParams, pairs_with, check, module, source,
                                        outputs)
            return factory

        return decorator

    def get(self, name: str, where: str = "") -> Entry[F]:
        """The entry for ``name``; unknown names raise a ConfigError with suggestions."""
        if name in self._entries:
            return self._entries[name]
        raise ConfigError(
            f"unknown {self.kind} '{name}'; {did_you_mean(name, self._entries)}registered: {', '.join(self.names())}",
            where,
        )

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

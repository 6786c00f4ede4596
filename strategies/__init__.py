"""Strategy plug-ins: Flower strategies registered in ``STRATEGIES``, installed as
``fedmech_flwr.builtin.strategies``.

How to add one: import what it needs from ``fedmech_flwr.api.strategy`` and
``fedmech_flwr.api`` (built-ins also from the private ``fedmech_flwr.api._builtin``; never
another plug-in), subclass ``WeightedFedAvg`` or another Flower strategy,
override one step (the way Flower's FedProx overrides ``configure_train``), write a
factory ``f(params, ctx) -> Strategy`` that passes ``**OFFERED_NODES_ONLY``, register it
with ``@STRATEGIES.register("name", ConfigCls)`` (``pairs_with=`` when it needs a
particular client, ``check=`` for rules between its parameters and the experiment or its
data, run at validation) and import the module here. Sampling, failure policy and
diagnostics come from the round protocol that wraps every strategy.
Work on the clients' data is a client query: register its handler in
``CLIENT_QUERIES`` (``class_stats`` is one).
"""

from . import (  # noqa: F401
    circuit_masked,
    class_stats,
    fedavg,
    fedbabu,
    feddecorr,
    feddyn,
    fedetf,
    fednova,
    fedopt,
    fedprox,
    fedrod,
    fedrs,
    matched_avg,
    moon,
    realign,
    scaffold,
)

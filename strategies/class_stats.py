"""The clients' per-class feature statistics of a model: a strategy's client-side query.

Data-free head realignment (``ncm``, ``ccvr``) sends the new aggregate in
``query.class_stats``; each ClientApp replies with per-class statistics of its penultimate
features on the client's whole data (``stats``: a ``ClassStats``, counts, sums, second
moments; no samples leave), and the server sums them (``strategies.realign``). The two
sides share only the query's name and ``ClassStats``, both public.
"""

from __future__ import annotations

from flwr.app import RecordDict

from fedmech_flwr.api._builtin import class_stats, features
from fedmech_flwr.api.strategy import CLIENT_QUERIES, QueryContext, to_record

CLASS_STATS_ACTION = "class_stats"
"""``query.class_stats``: a client's per-class feature statistics of the sent model."""


@CLIENT_QUERIES.register(CLASS_STATS_ACTION)
def report_class_stats(ctx: QueryContext) -> RecordDict:
    """Client side: the statistics of ``ctx.model``'s features on the client's data."""
    covariance = str(ctx.config["covariance"])
    stats = class_stats(features(ctx.model, ctx.x, batch_size=ctx.batch_size), ctx.y, ctx.num_classes, covariance)
    return RecordDict({"stats": to_record(stats.to_arrays())})


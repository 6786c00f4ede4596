"""The clients' per-class feature statistics of a model: a strategy's client-side query.

Data-free head realignment (``ncm``, ``ccvr``) sends the new aggregate in
``query.class_stats``; each ClientApp replies with per-class statistics of its penultimate
features on the client's whole data (``stats``: counts, sums, second moments; no samples
leave), and the server sums them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from flwr.app import ArrayRecord, ConfigRecord, RecordDict
from flwr.serverapp import Grid

from fedmech_flwr.arrays import from_record, to_record
from fedmech_flwr.heads import ClassStats, Covariance, class_stats, features
from fedmech_flwr.strategy import CLIENT_QUERIES, QueryContext
from fedmech_flwr.wire import query_nodes

log = logging.getLogger(__name__)

CLASS_STATS_ACTION = "class_stats"
"""``query.class_stats``: a client's per-class feature statistics of the sent model."""


@CLIENT_QUERIES.register(CLASS_STATS_ACTION)
def report_class_stats(ctx: QueryContext) -> RecordDict:
    """Client side: the statistics of ``ctx.model``'s features on the client's data."""
    covariance = str(ctx.config["covariance"])
    stats = class_stats(features(ctx.model, ctx.x, batch_size=ctx.batch_size), ctx.y, ctx.num_classes, covariance)
    return RecordDict({"stats": to_record(stats.to_arrays())})


def request_class_stats(
    grid: Grid, node_ids: Iterable[int], arrays: ArrayRecord, config: ConfigRecord, covariance: Covariance, timeout: float
) -> ClassStats:
    """Server side: ask nodes for per-class statistics of ``arrays``' penultimate features
    on their own data; return the statistics summed over the nodes that answered (failures
    are logged). ``config`` must carry the experiment and the round (the train config does)."""
    query = ConfigRecord({**dict(config), "covariance": covariance})
    parts, failed = [], []
    for reply in query_nodes(grid, node_ids, CLASS_STATS_ACTION, arrays, query, timeout):
        if reply.has_error():
            failed.append(reply.metadata.src_node_id)
            log.warning("node %d sent no class statistics: %s", reply.metadata.src_node_id, reply.error.reason)
            continue
        parts.append(ClassStats.from_arrays(from_record(reply.content["stats"])))
    if not parts:
        raise RuntimeError(f"no node returned class statistics (failed: {failed})")
    return ClassStats.sum(parts)

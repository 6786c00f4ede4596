"""The wire protocol between the server and the ClientApp: record keys, query actions
and ``query_nodes``. Both sides import it, so neither imports the other."""

from __future__ import annotations

from collections.abc import Iterable

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

REPORT_KEY = "report"
"""Name of the ConfigRecord in a reply with the client's partition-id, details and
client-side diagnostic results."""
CONFIG_KEY = "fedmech-config"
"""ConfigRecord key holding the resolved experiment config as JSON (sent to clients)."""
DIAGNOSE_ACTION = "diagnose"
"""``query.diagnose``: run ``client_side_global`` diagnostics on the new aggregate."""
IDENTIFY_ACTION = "identify"
"""``query.identify``: a user's own ClientApp (``fedmech_flwr.app.flower``) says which partition
it holds; this project's ClientApp answers the plain ``query`` instead."""
DATA_SPEC_KEY = "fedmech-data-spec"
"""ConfigRecord key holding what a node's own data must match (``NodeDataSpec`` as JSON)."""
CLIENT_STATE_KEY = "client-state"
"""A client's own state across rounds (``FedMechClient.state``): an ArrayRecord of this name
in the node's ``context.state`` and, after a resume, in its first train message; packed
bytes under this key in a train reply's report, the server's copy for resuming."""
UPLOAD_PREFIX = "upload:"
"""Report keys ``upload:<name>``: packed arrays a client sends its strategy besides the
weights (``FedMechClient.upload``)."""
PARTITION_IDS_KEY = "fedmech-client-ids"
"""ConfigRecord key holding ``{node_id: partition_id}`` as JSON (own-data nodes learn their
partition id)."""


def query_nodes(
    grid: Grid, node_ids: Iterable[int], action: str, arrays: ArrayRecord, config: ConfigRecord, timeout: float
) -> Iterable[Message]:
    """Send ``query.<action>`` to every node and collect the replies: how a strategy has the
    ClientApps run a client query (``CLIENT_QUERIES``) on their own data.

    Parameters
    ----------
    grid : flwr.serverapp.Grid
        The grid the strategy's ``start`` was given.
    node_ids : iterable of int
        The nodes to ask.
    action : str
        The name the query handler is registered under in ``CLIENT_QUERIES``.
    arrays : flwr.app.ArrayRecord
        Sent to every node (the global model, say).
    config : flwr.app.ConfigRecord
        Sent to every node.
    timeout : float
        Seconds to wait for the replies.

    Returns
    -------
    iterable of flwr.app.Message
        The replies that arrived within ``timeout`` (errors included).

    Examples
    --------
    >>> replies = query_nodes(grid, grid.get_node_ids(), "class-stats", arrays, ConfigRecord(), 60.0)  # doctest: +SKIP
    """
    messages = [
        Message(RecordDict({"arrays": arrays, "config": config}), dst_node_id=node, message_type=f"{MessageType.QUERY}.{action}")
        for node in node_ids
    ]
    return grid.send_and_receive(messages, timeout=timeout)

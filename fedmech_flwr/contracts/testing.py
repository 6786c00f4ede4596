"""Mocked Flower messages for a plug-in's tests (no SuperLink, no Ray).

``train_replies`` builds the replies a strategy's ``aggregate_train`` gets, so its test can
compare the aggregate with a hand-computed one (Flower's own strategy tests do the same).
It wraps the one Flower internal this needs: ``TaskIdentity``, which ``Message`` reads
when built outside a real run.
"""

from __future__ import annotations

from flwr.app import Message, MessageType, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from fedmech_flwr.learning.arrays import NamedArrays, to_record

SERVER_NODE_ID = 1
FIRST_CLIENT_NODE_ID = 1000
"""The node id of the first mocked client; the others follow."""


def server_identity(run_id: int = 1) -> None:
    """Let ``Message`` be built outside a real run, as the server of run ``run_id``."""
    TaskIdentity.run_id = run_id
    TaskIdentity.node_id = SERVER_NODE_ID
    TaskIdentity.task_id = 1


def train_replies(models: list[NamedArrays], num_examples: list[int]) -> list[Message]:
    """Mocked clients' train replies, as the ClientApp sends them: what a strategy's
    ``aggregate_train`` gets, for a test against a hand-computed aggregate (no SuperLink, no Ray).

    Parameters
    ----------
    models : list of NamedArrays
        Each client's weights.
    num_examples : list of int
        Each client's ``num-examples``.

    Returns
    -------
    list of flwr.app.Message
        One reply per client, from nodes 1000, 1001, ...

    Examples
    --------
    >>> import numpy as np
    >>> replies = train_replies([{"w": np.zeros(2)}, {"w": np.ones(2)}], [1, 3])
    >>> len(replies)
    2
    """
    server_identity()
    replies = []
    for i, (arrays, count) in enumerate(zip(models, num_examples, strict=True)):
        sent = Message(RecordDict(), dst_node_id=FIRST_CLIENT_NODE_ID + i, message_type=MessageType.TRAIN)
        content = RecordDict({"arrays": to_record(arrays), "metrics": MetricRecord({"num-examples": count})})
        replies.append(Message(content, reply_to=sent))
    return replies

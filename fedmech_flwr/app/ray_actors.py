"""Flower's Ray actors when a Ray node is lost, or when runs share a cluster.

Flower 1.42's simulation runs each ClientApp call on an actor of a pool
(``RayBackend.process_message``, ``flwr/server/superlink/fleet/vce/backend/raybackend.py``):
it pops an idle actor, waits for the call (``ray.get``), and puts the actor back, also when
the call failed. When a node of the cluster dies, the calls of its actors fail with a
``RayActorError`` (``ActorUnavailableError`` within seconds, ``ActorDiedError`` once Ray
has declared the node dead), which Flower's worker turns into an error reply; the dead
actor goes back to the pool and every later call handed to it fails at once, so from then
on which clients fail depends on which client drew which actor. And Flower creates one
actor per ``cpus_per_client`` CPUs of the whole cluster, so runs that share it each get
actors that wait for the others' to end: a call handed to such an actor waits with them.

``install()`` replaces that one method, for the Flower version it was written against
only, by one that hands calls only to placed actors (an actor waiting for CPUs takes calls
once it has them), drops an actor whose call failed with a ``RayActorError`` from the pool
for good, and replies for that client with ``RayNodeLost``, naming the actor's node. When
no actor is left, every later call fails at once with that error. The failure policy
(``federation.on_client_failure``) then stops the run or goes on with the other actors.
On any other Flower version Flower's own method stays, with one log line.
"""

from __future__ import annotations

import logging
import re
import threading
from typing import Any

import flwr

log = logging.getLogger(__name__)

FLOWER_VERSION = "1.42.0"
"""The Flower release whose ``RayBackend.process_message`` this module replaces."""
WAIT_S = 0.5
"""How often a call waiting for a placed actor looks again."""
LOST_NODE = re.compile(r"RayNodeLost: Ray node (\S+) ")
"""Finds the lost node's id in a ``RayNodeLost`` reason (a failure record's ``ray_node``)."""


class RayNodeLost(RuntimeError):
    """The actor running a client was lost: its Ray node died or its process was killed."""


def install(grid: Any, version: str = flwr.__version__) -> bool:
    """Replace Flower's ``RayBackend.process_message`` (``True``) in Flower's simulation,
    whose ``InMemoryGrid`` shares this process with the Ray backend; ``False`` on any
    other Grid or Flower version. Idempotent."""
    from flwr.superlink.grid import InMemoryGrid

    if not isinstance(grid, InMemoryGrid):
        return False
    if version != FLOWER_VERSION:
        log.info("Flower %s: the Ray actor pool's handling of lost nodes is written for Flower %s and is not used; "
                 "a lost Ray node's actors stay in the pool and fail the calls handed to them", version, FLOWER_VERSION)
        return False
    from flwr.server.superlink.fleet.vce.backend.raybackend import RayBackend

    RayBackend.process_message = process_message
    return True


def lost_node(reason: str) -> str | None:
    """The id of the Ray node a failure reason says was lost, if it says so."""
    found = LOST_NODE.search(reason)
    return found.group(1) if found else None


class _Actors:
    """What the pool needs beside Flower's list of idle actors: a condition that threads
    waiting for an actor wait on, and each actor's readiness (``__ray_ready__``)."""

    _lock = threading.Lock()

    def __init__(self) -> None:
        self.changed = threading.Condition()
        self.ready: dict[str, Any] = {}
        self.lost: list[str] = []

    @classmethod
    def of(cls, pool: Any) -> _Actors:
        with cls._lock:
            if not hasattr(pool, "_fedmech_actors"):
                pool._fedmech_actors = cls()
            return pool._fedmech_actors


def _take(pool: Any, actors: _Actors, cid: str) -> Any:
    """An idle actor that Ray has placed, waiting while there is none; a ``RayNodeLost``
    when the pool has no actor left."""
    import ray

    with actors.changed:
        while True:
            if pool.num_actors == 0:
                raise RayNodeLost(f"no Ray actor is left to run client {cid}: {'; '.join(actors.lost)}")
            for actor in pool.pool:
                if actor._actor_id.hex() not in actors.ready:
                    actors.ready[actor._actor_id.hex()] = actor.__ray_ready__.remote()
            refs = {actors.ready[a._actor_id.hex()]: a for a in pool.pool}
            placed, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0) if refs else ([], [])
            if placed:
                actor = refs[placed[-1]]
                pool.pool.remove(actor)
                return actor
            actors.changed.wait(WAIT_S)


def _node_of(actor: Any) -> tuple[str, str]:
    """The id and address of the node Ray placed ``actor`` on (Ray's actor table)."""
    from ray._private import state

    try:
        address = state.actors(actor._actor_id.hex())["Address"]
        return address["NodeID"], address["IPAddress"]
    except Exception:  # the table unreadable (the head gone too): the node is named unknown
        return "unknown", "unknown address"


def process_message(self: Any, message: Any, context: Any) -> tuple[Any, Any]:
    """Flower 1.42's ``RayBackend.process_message``, but the call goes to a placed actor,
    and an actor lost with its node leaves the pool (see the module docstring)."""
    import ray
    from flwr.common.constant import PARTITION_ID_KEY

    if self.pool is None or self.app_fn is None:
        raise ValueError("The Ray backend was not built: call its build() before processing messages.")
    pool, actors = self.pool, _Actors.of(self.pool)
    cid = str(context.node_config[PARTITION_ID_KEY])
    actor = _take(pool, actors, cid)
    try:
        _, reply, context = ray.get(actor.run.remote(self.app_fn, message, cid, context))
    except ray.exceptions.RayActorError as err:
        node, address = _node_of(actor)
        ray.kill(actor, no_restart=True)  # one only unreachable for a while would hold its CPUs for good
        lost = f"Ray node {node} ({address}) lost client {cid}'s actor ({type(err).__name__})"
        with actors.changed:
            pool.num_actors -= 1
            actors.lost.append(lost)
            actors.changed.notify_all()
        log.error("%s: the node died or the actor's process was killed; %d actor(s) left", lost, pool.num_actors)
        raise RayNodeLost(f"{lost}; {pool.num_actors} actor(s) left") from err
    except BaseException:
        with actors.changed:
            pool.pool.append(actor)
            actors.changed.notify_all()
        raise
    with actors.changed:
        pool.pool.append(actor)
        actors.changed.notify_all()
    return reply, context

"""Fault injection for tests: the real ClientApp, with chosen clients misbehaving in
chosen rounds. Test-only by construction: it lives in tests/ and production code has no
fault hooks; a test passes ``faulty_app(...)`` to ``run_in_process`` as its ClientApp.

Kinds: ``raise`` (the client raises), ``nan`` / ``inf`` (the client returns a weight
array with NaN / Inf), ``hang`` (the client replies ``HANG_S`` seconds late; use a
``federation.round_timeout_s`` below that), ``explode`` (finite weights so large that
the global model's loss overflows), ``crash`` (the whole run dies, as under SIGKILL).
``INJECTED`` counts the faults injected in this test session, by kind.

A full disk: ``fill`` fills a small tmpfs (the ``disk`` fixture) with a ballast file at
the moment a test chooses.
"""

from __future__ import annotations

import errno
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from fedmech_flwr.app import client_app
from fedmech_flwr.learning.arrays import from_record, to_record

HANG_S = 4.0
INJECTED: Counter[str] = Counter()


class SimulatedCrash(BaseException):
    """Stands in for a kill: not an ``Exception``, so no handler turns it into a failed
    client; it unwinds the whole run."""


@dataclass(frozen=True)
class Fault:
    kind: str
    partition_id: int
    round: int


def faulty_app(*faults: Fault) -> ClientApp:
    """The real ClientApp, except that each fault fires for its partition and round."""
    app = ClientApp()
    by_target = {(f.partition_id, f.round): f.kind for f in faults}

    @app.query(client_app.IDENTIFY_ACTION)
    def identify(msg: Message, context: Context) -> Message:
        return client_app.identify(msg, context)

    @app.query(client_app.DIAGNOSE_ACTION)
    def diagnose(msg: Message, context: Context) -> Message:
        return client_app.diagnose(msg, context)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        target = (int(context.node_config["partition-id"]), int(msg.content["config"]["server-round"]))
        kind = by_target.get(target)
        if kind is None:
            return client_app.train(msg, context)
        INJECTED[kind] += 1
        if kind == "raise":
            raise RuntimeError("injected crash")
        if kind == "crash":
            raise SimulatedCrash(f"killed in client {target[0]}'s training in round {target[1]}")
        if kind == "hang":
            time.sleep(HANG_S)
            return client_app.train(msg, context)
        reply = client_app.train(msg, context)
        arrays = from_record(reply.content["arrays"])
        if kind == "explode":
            arrays = {k: v * np.float32(1e30) if v.dtype == np.float32 else v for k, v in arrays.items()}
        else:
            bad = arrays["conv1.weight"].copy()
            bad.flat[0] = np.nan if kind == "nan" else np.inf
            arrays["conv1.weight"] = bad
        reply.content["arrays"] = to_record(arrays)
        return reply

    return app


def fill(disk: Path) -> Path:
    """Fill ``disk`` with a ballast file until it is full; return the ballast."""
    ballast = disk / "ballast"
    with open(ballast, "wb") as out:
        try:
            while True:
                out.write(bytes(2**16))
                out.flush()
        except OSError as err:
            assert err.errno == errno.ENOSPC
    return ballast

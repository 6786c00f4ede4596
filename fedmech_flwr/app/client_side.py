"""The diagnostics' part on a node, the same for this project's ClientApp and a user's own
(``fedmech_flwr.app.flower.attach_diagnostics``): the contexts they see and the records
the server reads back.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch
from flwr.app import ConfigRecord, Message, RecordDict

from fedmech_flwr.contracts.hooks import ClientContext, GlobalContext, encode_results
from fedmech_flwr.contracts.wire import REPORT_KEY
from fedmech_flwr.models import FedMechModel
from fedmech_flwr.spec.config import DiagnosticSpec


@dataclass(frozen=True)
class NodeRound:
    """What a node holds in one round: the diagnostics, its partition id and its own data."""

    diagnostics: list[DiagnosticSpec]
    server_round: int
    partition_id: int
    x: torch.Tensor
    y: torch.Tensor
    num_classes: int
    device: torch.device
    seed: int

    def train_report(self, received: FedMechModel, trained: FedMechModel, details: dict[str, Any]) -> ConfigRecord:
        """A train reply's ``report``: the partition id, ``details`` (per-client values that
        must not be averaged) and the due diagnostics' ``client_side`` results on the
        model received and the model trained."""
        ctx = ClientContext(self.server_round, self.partition_id, received, trained, self.x, self.y,
                            self.num_classes, self.device, self.seed)
        results = {}
        for spec in self.diagnostics:
            if spec.due(self.server_round) and (out := spec.build().client_side(ctx)):
                results[spec.name] = out
        return ConfigRecord({"partition-id": self.partition_id, "details": json.dumps(details),
                             **encode_results(results)})

    def diagnose_reply(self, msg: Message, model: FedMechModel) -> Message:
        """The reply to ``query.diagnose``: the due diagnostics' ``client_side_global``
        results on the new aggregate ``model``."""
        ctx = GlobalContext(self.server_round, self.partition_id, model, self.x, self.y, self.num_classes,
                            self.device, self.seed)
        results = {}
        for spec in self.diagnostics:
            if not spec.due(self.server_round):
                continue
            diagnostic = spec.build()
            if diagnostic.needs_global_pass() and (out := diagnostic.client_side_global(ctx)):
                results[spec.name] = out
        report = ConfigRecord({"partition-id": self.partition_id, **encode_results(results)})
        return Message(RecordDict({REPORT_KEY: report}), reply_to=msg)

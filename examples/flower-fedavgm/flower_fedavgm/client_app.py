"""The app's ClientApp: local training on the node's partition, plus fedmech's diagnostics."""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedmech_flwr.api import seed_for
from fedmech_flwr.api.model import FedMechModel
from fedmech_flwr.app.flower import attach_diagnostics
from flower_fedavgm.task import load_federation, make_model, train

app = ClientApp()


def node_model(context: Context) -> FedMechModel:
    """A fresh model of this run."""
    return make_model(str(context.run_config["dataset"]), int(context.run_config["seed"]))


def node_data(context: Context) -> tuple[torch.Tensor, torch.Tensor]:
    """This node's training images and labels: its partition of the run's dataset."""
    rc, nc = context.run_config, context.node_config
    federation = load_federation(str(rc["dataset"]), int(nc["num-partitions"]), float(rc["alpha"]),
                                 int(rc["audit-per-class"]), int(rc["seed"]))
    return federation.shard(int(nc["partition-id"]))


@app.train()
def train_fn(msg: Message, context: Context) -> Message:
    torch.set_num_threads(1)  # one core per simulated client; fixed, so runs repeat bitwise
    rc = context.run_config
    model = node_model(context)
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    x, y = node_data(context)
    seed = seed_for(int(rc["seed"]), "local-training", int(context.node_config["partition-id"]),
                    int(msg.content["config"]["server-round"]))
    loss = train(model, x, y, int(rc["local-epochs"]), float(rc["lr"]), int(rc["batch-size"]), seed)
    metrics = MetricRecord({"train-loss": loss, "num-examples": len(x)})
    return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics}), reply_to=msg)


# After @app.train(): the diagnostics' queries, and their part after local training.
attach_diagnostics(app, node_model, node_data)

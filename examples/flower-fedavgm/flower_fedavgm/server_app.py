"""The app's ServerApp: Flower's FedAvgM, wrapped so that fedmech's diagnostics run after
every aggregation and a run folder records them."""

from __future__ import annotations

from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvgM

from fedmech_flwr.app.flower import WithDiagnostics
from flower_fedavgm.task import load_federation, make_model

app = ServerApp()



def diagnostics(head_samples: int) -> list[dict]:
    """What runs after every aggregation, written as in a fedmech experiment."""
    return [
        # local circuits on each client's data, the global model's circuits in each
        # client's context, IoUs and ablations on the server (a balanced test subset)
        {"name": "circuits", "every": 1, "ablation_samples": 40},
        # a probe and the head realigned on the server's audit set, and NCM / CCVR heads
        # from class statistics the clients compute on their own data
        {"name": "misalignment", "every": 1, "head_samples": head_samples, "client_stats": ["ncm", "ccvr"]},
    ]


@app.main()
def main(grid: Grid, context: Context) -> None:
    rc = context.run_config
    dataset, seed, num_partitions = str(rc["dataset"]), int(rc["seed"]), int(rc["num-partitions"])
    federation = load_federation(dataset, num_partitions, float(rc["alpha"]), int(rc["audit-per-class"]), seed)
    strategy = FedAvgM(server_momentum=float(rc["server-momentum"]), fraction_evaluate=0.0, min_train_nodes=1,
                       min_available_nodes=1)
    diagnosed = WithDiagnostics(
        strategy,
        lambda: make_model(dataset, seed),
        {"name": "flower-fedavgm", "seed": seed, "federation": {"num_clients": num_partitions},
         "diagnostics": diagnostics(int(rc["head-samples"]))},
        test=(federation.x_test, federation.y_test),
        audit=federation.audit_set(),
        out=str(rc["out"]) or None,
    )
    diagnosed.start(grid, ArrayRecord(make_model(dataset, seed).state_dict()), num_rounds=int(rc["num-server-rounds"]))

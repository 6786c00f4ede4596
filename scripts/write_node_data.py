#!/usr/bin/env python
"""Write per-node data files from an experiment's dataset and partition: a test
federation whose nodes bring their own data (``fedmech deploy-local --node-data DIR``,
or ``flower-supernode --node-config "data-path=DIR/node_000.npz"``).

    .venv/bin/python scripts/write_node_data.py experiments/smoke.yaml OUT_DIR [--set KEY=VALUE ...]
        [--clients 0,2] [--format npz|images]

Each file holds one client's shard of the partition the experiment draws with its seed
(``node_III.npz``: uint8 pixels ``x`` [N,H,W,C] and labels ``y``; ``images``: a folder
``node_III/CLASS/NNNNN.png`` per node, class folders named by class index).
"""

from __future__ import annotations

import argparse
import sys

from fedmech_flwr.app.node_data import NODE_FORMATS, write_node_data
from fedmech_flwr.contracts import plugins
from fedmech_flwr.foundation.errors import ConfigError
from fedmech_flwr.spec.experiment import load_experiment


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("experiment", help="experiment YAML file (dataset, partition, seed, num_clients)")
    parser.add_argument("out", help="folder to write the node files into")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config value")
    parser.add_argument("--clients", help="comma-separated partition-ids to write (default: all)")
    parser.add_argument("--format", choices=NODE_FORMATS, default="npz")
    args = parser.parse_args(argv)
    plugins.load()
    try:
        cfg = load_experiment(args.experiment, args.set)
        partition_ids = [int(c) for c in args.clients.split(",")] if args.clients else None
        for path in write_node_data(cfg, args.out, partition_ids, args.format):
            print(path)
    except (ConfigError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

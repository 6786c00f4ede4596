"""What a data plug-in needs: the dataset registry and what a dataset returns, and the
partition registry (a partition splits the training labels among the clients).

Examples
--------
>>> import numpy as np
>>> from fedmech_flwr.api.data import PARTITIONERS
>>> @PARTITIONERS.register("round_robin")
... def round_robin(labels, num_clients, cfg, seed):
...     return [np.arange(i, len(labels), num_clients) for i in range(num_clients)]
"""

from __future__ import annotations

from fedmech_flwr.datasets.data import DATASETS, DatasetBundle
from fedmech_flwr.datasets.partition import PARTITIONERS

__all__ = ["DATASETS", "DatasetBundle", "PARTITIONERS"]

"""What a model plug-in needs: its registry, the interface diagnostics rely on, a way to
wrap any ``nn.Module`` behind it, and the builder a test or a strategy builds models with.

Examples
--------
>>> from torch import nn
>>> from fedmech_flwr.api.model import MODELS, wrap_module
>>> @MODELS.register("tiny_mlp")
... def tiny_mlp(cfg, *, in_channels, num_classes, image_size):
...     module = nn.Sequential(nn.Flatten(), nn.Linear(in_channels * image_size**2, 32), nn.ReLU(),
...                            nn.Linear(32, num_classes))
...     return wrap_module(module, input_shape=(in_channels, image_size, image_size))
"""

from __future__ import annotations

from fedmech_flwr.contracts.conformance import check_model
from fedmech_flwr.models import MODELS, FedMechModel, build_model, wrap_module

__all__ = [
    "MODELS", "FedMechModel", "build_model", "wrap_module",
    # testing
    "check_model",
]

"""Models; importing this package registers them in ``MODELS``."""

from __future__ import annotations

from fedmech_flwr.models import resnet, simple_cnn
from fedmech_flwr.models.base import MODELS, ChannelGroup, FedMechModel, build_model

__all__ = ["MODELS", "ChannelGroup", "FedMechModel", "build_model", "resnet", "simple_cnn"]

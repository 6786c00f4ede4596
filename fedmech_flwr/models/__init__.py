"""Models; importing this package registers them in ``MODELS``."""

from __future__ import annotations

from fedmech_flwr.models import resnet, simple_cnn, torchvision_models
from fedmech_flwr.models.base import MODELS, ChannelGroup, FedMechModel, build_model
from fedmech_flwr.models.wrapped import WrappedModel, wrap_module

__all__ = [
    "MODELS", "ChannelGroup", "FedMechModel", "WrappedModel", "build_model", "resnet",
    "simple_cnn", "torchvision_models", "wrap_module",
]

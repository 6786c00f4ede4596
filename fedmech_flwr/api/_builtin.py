"""Private: what the built-in plug-ins use beyond the public API (heads, masks, run-folder
files, training helpers...). Not part of the API's promise, and may change in any release.

Only ``fedmech_flwr.builtin`` may import this module (``tests/test_import_graph.py`` fails
otherwise, and ``fedmech_flwr.contracts.plugins`` warns a user's plug-in that does). A name a user's
plug-in needs belongs in a public face instead (``fedmech_flwr.api.strategy``, ...).
"""

from __future__ import annotations

from typing import Any

from fedmech_flwr.artifacts.folder import CHECKPOINT_DIR, CONFIG_FILE, FINAL_MODEL_FILE, read_records, round_file
from fedmech_flwr.contracts.hooks import decode_results
from fedmech_flwr.contracts.outputs import DEGENERATE_FRACTION, either, lookup, one_class, under_powered
from fedmech_flwr.contracts.strategy import SENT_ACCURACY, parameter_names, weighted_fedavg
from fedmech_flwr.contracts.wire import REPORT_KEY
from fedmech_flwr.foundation.files import save_figure, write_text_atomic
from fedmech_flwr.foundation.timing import Clock
from fedmech_flwr.foundation.typed import join_key, parse_dataclass, to_plain
from fedmech_flwr.foundation.yaml_text import read_yaml_file
from fedmech_flwr.learning.arrays import cast, l2_norm, load_arrays, load_model_arrays, model_arrays, save_arrays
from fedmech_flwr.learning.heads import (
    ClassStats,
    Covariance,
    LinearHead,
    LinearTrainConfig,
    Scores,
    balanced_split,
    best_epoch,
    ccvr_head,
    ccvr_train_config,
    class_stats,
    features,
    features_at,
    head_set_per_class,
    ncm_head,
    score,
    tau_normalize,
    train_linear,
)
from fedmech_flwr.learning.masks import MaskLike, pack_masks, to_bools, unpack_masks
from fedmech_flwr.learning.training import (
    a_norm,
    channels_last,
    channels_last_copy,
    largest_predicted_class,
    make_optimizer,
    resolve_device,
)
from fedmech_flwr.models import ChannelGroup
from fedmech_flwr.spec.checks import all_of, dense_only, plain_sgd_only, sgd_only
from fedmech_flwr.spec.config import apply_overrides
from fedmech_flwr.spec.experiment import audit_indices, load_data, load_experiment, model_builder

__all__ = [
    # arrays and masks
    "MaskLike", "cast", "l2_norm", "load_arrays", "load_model_arrays", "model_arrays", "pack_masks", "save_arrays",
    "to_bools", "unpack_masks",
    # strategies
    "ChannelGroup", "REPORT_KEY", "SENT_ACCURACY", "all_of", "decode_results", "dense_only", "parameter_names",
    "plain_sgd_only", "sgd_only", "weighted_fedavg",
    # training
    "a_norm", "channels_last", "channels_last_copy", "largest_predicted_class", "make_optimizer", "resolve_device",
    # linear heads on frozen features
    "ClassStats", "Covariance", "LinearHead", "LinearTrainConfig", "Scores", "balanced_split", "best_epoch",
    "ccvr_head", "ccvr_train_config", "class_stats", "features", "features_at", "head_set_per_class", "ncm_head",
    "score", "tau_normalize", "train_linear",
    # records
    "Clock", "DEGENERATE_FRACTION", "either", "lookup", "one_class", "under_powered",
    # the experiment and its run folder, for commands and analyses
    "CHECKPOINT_DIR", "CONFIG_FILE", "FINAL_MODEL_FILE", "apply_overrides", "audit_indices", "join_key",
    "load_data", "load_experiment", "model_builder", "parse_dataclass", "read_records", "read_yaml_file",
    "round_file", "save_figure", "to_plain", "write_text_atomic",
    # figures (imported on first use)
    "class_labels",
]


def __getattr__(name: str) -> Any:
    if name == "class_labels":  # matplotlib is the server's alone
        from fedmech_flwr.artifacts import plotting

        return plotting.class_labels
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""FedAvg followed by a new head: the lesson of arXiv 2512.23043 turned into strategies.

Under label skew the averaged body still separates the classes while the averaged head
stops reading them. Each strategy here is Flower's FedAvg (fedmech's dtype-preserving
average) that overrides one step, ``aggregate_train``: after averaging, on its schedule,
it replaces the head of the aggregate; the next round starts from that model.

- ``fedavg_head_realign``: finetune the head on a small balanced part of the server's
  audit set (``data.audit_per_class``, held out from every client), epoch selected on the
  rest of the audit set. Server data: the audit set. Client: any.
- ``ncm``: the nearest-class-mean head from the clients' per-class feature means of the
  new aggregate. Server data: none. Client: any (every ClientApp answers
  ``query.class_stats``, which the ``class_stats`` plug-in registers; one extra round trip
  per realignment).
- ``ccvr``: Classifier Calibration with Virtual Representations (Luo et al. 2021,
  arXiv:2106.05001): retrain the head on features sampled from class Gaussians built from
  the clients' means and covariances. Server data: none. Client: any (as ``ncm``).
- ``tau_norm``: tau-normalised class weights (Kang et al. 2020, arXiv:1910.09217), the
  zero-cost control. Server data: none. Client: any. No round trip.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid

from fedmech_flwr.api import DataInfo, ExperimentConfig, torch_generator
from fedmech_flwr.api._builtin import (
    ClassStats,
    Covariance,
    LinearHead,
    LinearTrainConfig,
    balanced_split,
    best_epoch,
    ccvr_head,
    ccvr_train_config,
    features,
    head_set_per_class,
    join_key,
    model_arrays,
    ncm_head,
    tau_normalize,
    train_linear,
)
from fedmech_flwr.api.model import FedMechModel
from fedmech_flwr.api.strategy import (
    OFFERED_NODES_ONLY,
    STRATEGIES,
    FedAvgConfig,
    StrategyContext,
    WeightedFedAvg,
    from_record,
    query_nodes,
    to_record,
)

log = logging.getLogger(__name__)

CLASS_STATS_QUERY = "class_stats"
"""The client query that answers with a client's per-class feature statistics (the
``class_stats`` plug-in registers its handler in ``CLIENT_QUERIES``)."""


def request_class_stats(
    grid: Grid, node_ids: Iterable[int], arrays: ArrayRecord, config: ConfigRecord, covariance: Covariance, timeout: float
) -> ClassStats:
    """Ask nodes for per-class statistics of ``arrays``' penultimate features on their own
    data (``query.class_stats``); return the statistics summed over the nodes that answered
    (failures are logged). ``config`` must carry the experiment and the round (the train
    config does)."""
    query = ConfigRecord({**dict(config), "covariance": covariance})
    parts, failed = [], []
    for reply in query_nodes(grid, node_ids, CLASS_STATS_QUERY, arrays, query, timeout):
        if reply.has_error():
            failed.append(reply.metadata.src_node_id)
            log.warning("node %d sent no class statistics: %s", reply.metadata.src_node_id, reply.error.reason)
            continue
        parts.append(ClassStats.from_arrays(from_record(reply.content["stats"])))
    if not parts:
        raise RuntimeError(f"no node returned class statistics (failed: {failed})")
    return ClassStats.sum(parts)


@dataclass
class RealignConfig(FedAvgConfig):
    every: int | None = field(default=1, metadata={"ge": 1})
    """Realign after every N-th aggregation and always after the final one; null: only
    after the final round (the federated trajectory is then plain FedAvg's)."""


class RealigningFedAvg(WeightedFedAvg):
    """FedAvg, then ``realign`` replaces the aggregate's head in the rounds it is due."""

    def __init__(self, params: RealignConfig, ctx: StrategyContext) -> None:
        super().__init__(weighting=params.weighting, **OFFERED_NODES_ONLY)
        self.every = params.every
        self.ctx = ctx
        self._grid: Grid | None = None
        self._train_config = ConfigRecord()

    def due(self, server_round: int) -> bool:
        return server_round == self.ctx.num_rounds or (self.every is not None and server_round % self.every == 0)

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        messages = super().configure_train(server_round, arrays, config, grid)
        # Kept for strategies that query the clients after aggregation; FedAvg has written
        # "server-round" into ``config``.
        self._grid, self._train_config = grid, config
        return messages

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        arrays, metrics = super().aggregate_train(server_round, replies)
        if arrays is None or not self.due(server_round):
            return arrays, metrics
        model = self.ctx.build_model(from_record(arrays))
        nodes = [r.metadata.src_node_id for r in replies if not r.has_error()]
        self.realign(server_round, model, arrays, nodes).install(model.get_classifier())
        log.info("round %d: %s replaced the head of the aggregate", server_round, type(self).__name__)
        return to_record(model_arrays(model)), metrics

    def realign(self, server_round: int, model: FedMechModel, arrays: ArrayRecord, nodes: list[int]) -> LinearHead:
        """The new head for ``model`` (the aggregate; do not change it)."""
        raise NotImplementedError


@dataclass
class HeadRealignConfig(RealignConfig):
    head_samples: int = field(default=200, metadata={"ge": 1})
    """Balanced samples the head is finetuned on (head_samples / classes per class), drawn
    from the audit set; the rest of the audit set selects the epoch (the misalignment
    diagnostic's setting of the same name)."""
    head: LinearTrainConfig = field(default_factory=LinearTrainConfig)
    """The paper's recipe by default: AdamW lr 1e-3, wd 5e-4, cosine over 5 epochs, batch 16."""


def check_head_realign(params: HeadRealignConfig, cfg: ExperimentConfig, data: DataInfo, where: str) -> None:
    """The head set and the images that select its epoch both come from the audit set."""
    data.require_audit("fedavg_head_realign finetunes the head on", where, suggested=50)
    # every class keeps at least one image to select the epoch on
    head_set_per_class(params.head_samples, data.audit_per_class - 1, data.num_classes, join_key(where, "head_samples"))


class FedAvgHeadRealign(RealigningFedAvg):
    """FedAvg, then finetune only the head on the server's balanced audit subset."""

    def __init__(self, params: HeadRealignConfig, ctx: StrategyContext) -> None:
        super().__init__(params, ctx)
        x, y = ctx.audit  # check_head_realign made sure there is one, large enough
        per_class = head_set_per_class(params.head_samples, len(y) // ctx.num_classes - 1, ctx.num_classes,
                                       "strategy.head_samples")
        generator = torch_generator(ctx.seed, "head-realign-split")
        head_idx, rest = balanced_split(y, per_class, ctx.num_classes, generator)
        self.head_set = (x[head_idx], y[head_idx])
        self.val_set = (x[rest], y[rest])
        self.train_cfg = params.head

    def realign(self, server_round: int, model: FedMechModel, arrays: ArrayRecord, nodes: list[int]) -> LinearHead:
        f_head, f_val = features(model, self.head_set[0]), features(model, self.val_set[0])
        generator = torch_generator(self.ctx.seed, "head-realign", None, server_round)
        snapshots = train_linear(f_head, self.head_set[1], LinearHead.of(model), self.train_cfg, generator)
        return snapshots[best_epoch(snapshots, f_val, self.val_set[1], self.ctx.num_classes)]


class NearestClassMean(RealigningFedAvg):
    """FedAvg, then the head becomes the nearest-class-mean classifier of the clients'
    feature means of the new aggregate."""

    def realign(self, server_round: int, model: FedMechModel, arrays: ArrayRecord, nodes: list[int]) -> LinearHead:
        stats = request_class_stats(self._grid, nodes, arrays, self._train_config, "diagonal", self.ctx.round_timeout_s)
        return ncm_head(stats, LinearHead.of(model))


@dataclass
class CCVRConfig(RealignConfig):
    ccvr_covariance: Covariance = "diagonal"
    """Class Gaussians with diagonal or full covariance; full sends C x D x D floats per
    client (D = feature size), so diagonal is the default for conv features. The names
    are the misalignment diagnostic's for its CCVR head."""
    ccvr_virtual_per_class: int = field(default=1000, metadata={"ge": 1})
    """Virtual features sampled per class."""
    ccvr_train: LinearTrainConfig = field(default_factory=ccvr_train_config)
    """How the head is retrained on the virtual features (from the current head; the
    last epoch is kept: the server has no data to select on)."""


class CCVR(RealigningFedAvg):
    """FedAvg, then retrain the head on virtual features from the clients' class Gaussians."""

    def __init__(self, params: CCVRConfig, ctx: StrategyContext) -> None:
        super().__init__(params, ctx)
        self.params = params

    def realign(self, server_round: int, model: FedMechModel, arrays: ArrayRecord, nodes: list[int]) -> LinearHead:
        stats = request_class_stats(self._grid, nodes, arrays, self._train_config, self.params.ccvr_covariance,
                                   self.ctx.round_timeout_s)
        generator = torch_generator(self.ctx.seed, "ccvr", None, server_round)
        return ccvr_head(stats, LinearHead.of(model), self.params.ccvr_virtual_per_class, self.params.ccvr_train,
                         generator)


@dataclass
class TauNormConfig(RealignConfig):
    tau: float = field(default=1.0, metadata={"ge": 0.0})
    """Strength: 0 leaves the head unchanged, 1 gives every class weight unit norm."""


class TauNorm(RealigningFedAvg):
    """FedAvg, then tau-normalise the head's class weight norms."""

    def __init__(self, params: TauNormConfig, ctx: StrategyContext) -> None:
        super().__init__(params, ctx)
        self.tau = params.tau

    def realign(self, server_round: int, model: FedMechModel, arrays: ArrayRecord, nodes: list[int]) -> LinearHead:
        return tau_normalize(LinearHead.of(model), self.tau)


STRATEGIES.register("fedavg_head_realign", HeadRealignConfig, check=check_head_realign)(FedAvgHeadRealign)
STRATEGIES.register("ncm", RealignConfig)(NearestClassMean)
STRATEGIES.register("ccvr", CCVRConfig)(CCVR)
STRATEGIES.register("tau_norm", TauNormConfig)(TauNorm)

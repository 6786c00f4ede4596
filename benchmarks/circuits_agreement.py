"""Do the fast diagnostics agree with today's protocol? One fixed checkpoint, side by side.

Builds a seeded checkpoint (a SimpleCNN trained on CIFAR-10, then finetuned on a client
holding classes 0-2, pruned to the paper's 99.9% on the way) and compares, on that
client's data and the test set:

- circuits: the default gates (each class stops once its mask is stable; gated at the end
  of each block, in SimpleCNN's grouped forward where pruning left static channels)
  against the authors' code's protocol (``patience: null``, all 300 steps) hooked at the
  conv outputs as before: mean IoU per class, steps taken; and that protocol on the
  fast path against it (what the fast path alone changes);
- ablations: the batched pass on ``--ablation-samples`` images against one pass per
  combination on 1,000 (the old path): how many numbers lie inside the new number's 95%
  sampling interval of the old one (and how many of those outside belong to a degenerate
  ablation: one class predicted for more than 90% of the images, whose scores jump with
  which class that is), and the largest gap; and how many are equal to the old path's on
  the same images (the implementation alone);
- the misalignment probe: on features from the channels-last copy against features from
  the model as it is: accuracy difference in points.

    python benchmarks/circuits_agreement.py [--channels 64 128 256] [--sparsity 0.999] [--ablation-samples 500]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import time

import numpy as np
import torch
import torch.nn.functional as F

from fedmech_flwr.builtin.diagnostics.circuits.ablation import MODES, _scores, ablate, ablation_reports, channel_means, predict, random_like
from fedmech_flwr.builtin.diagnostics.circuits.diagnostic import _balanced_subset
from fedmech_flwr.builtin.diagnostics.circuits.discovery import learn_circuits
from fedmech_flwr.builtin.diagnostics.circuits.gates import GateConfig
from fedmech_flwr.builtin.diagnostics.circuits.metrics import circuit_iou
from fedmech_flwr.builtin.diagnostics.misalignment import Misalignment, MisalignmentConfig
from fedmech_flwr.contracts.outputs import DEGENERATE_FRACTION
from fedmech_flwr.datasets.data import CIFAR10Config, load_dataset
from fedmech_flwr.learning.heads import features
from fedmech_flwr.learning.pruning import MagnitudePruner, PruningConfig, overall_sparsity
from fedmech_flwr.models import build_model

CLIENT_CLASSES = [0, 1, 2]


def checkpoint(data, channels: list[int], samples: int, sparsity: float) -> tuple[torch.nn.Module, torch.Tensor]:
    """A model trained one epoch on ``samples`` seeded training images, then one epoch on a
    client's ``samples // 2`` images of ``CLIENT_CLASSES``, pruned by magnitude to
    ``sparsity`` over the first half of its steps (the paper's schedule); and that client's
    indices."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    model = build_model("simple_cnn", {"channels": channels}, in_channels=3, num_classes=10, image_size=32)
    pool = torch.nonzero(torch.isin(data.y_train, torch.tensor(CLIENT_CLASSES))).flatten()
    client = pool[torch.randperm(len(pool), generator=g)[: samples // 2]]
    batches = [batch for idx in (torch.randperm(len(data.y_train), generator=g)[:samples], client)
               for batch in idx.split(64)]
    pruner = MagnitudePruner(model, PruningConfig(target_sparsity=sparsity), len(batches))
    optimizer = torch.optim.Adam(model.parameters(), 1e-3)
    for step, batch in enumerate(batches):
        optimizer.zero_grad()
        F.cross_entropy(model(data.x_train[batch]), data.y_train[batch]).backward()
        optimizer.step()
        pruner.step(step)
    print(f"checkpoint: SimpleCNN {channels}, sparsity {overall_sparsity(model, include_head=False):.4f}, "
          f"grouped forward: {'yes' if model.grouped_forward() is not None else 'no (nothing static)'}")
    return model.eval(), client


def circuits(model, x, y, steps: int) -> dict:
    default = GateConfig(steps=steps)
    paper = dataclasses.replace(default, patience=None)
    at_conv = copy.deepcopy(model)
    at_conv.pooled_gate_module = lambda name: None  # gates hooked at the conv outputs, as before
    at_conv.grouped_forward = lambda: None
    runs = {}
    for name, cfg, m in (("paper, conv outputs", paper, at_conv), ("paper, fast path", paper, model),
                         ("default (early stop)", default, model)):
        start = time.perf_counter()
        runs[name] = learn_circuits(m, x, y, CLIENT_CLASSES, cfg, torch.Generator().manual_seed(7))
        print(f"circuits {name:<22} {runs[name].steps:>4} steps {time.perf_counter() - start:8.1f} s")
    old = runs["paper, conv outputs"].masks
    for name in ("default (early stop)", "paper, fast path"):
        ious = {c: round(circuit_iou(old[c], runs[name].masks[c]), 3) for c in CLIENT_CLASSES}
        print(f"circuits mean IoU {name} vs paper, conv outputs: {np.mean(list(ious.values())):.3f} per class {ious}")
    return old


def ablations(model, data, masks, samples: int) -> None:
    sizes = model.gated_layers()
    old_idx = _balanced_subset(data.y_test, 1000, 10, torch.Generator().manual_seed(1))
    new_idx = _balanced_subset(data.y_test, samples, 10, torch.Generator().manual_seed(1))
    x_old, y_old, x_new, y_new = data.x_test[old_idx], data.y_test[old_idx], data.x_test[new_idx], data.y_test[new_idx]
    g = torch.Generator().manual_seed(1)
    jobs = [(c, masks[c], random_like(masks[c], sizes, g)) for c in CLIENT_CLASSES]
    start = time.perf_counter()
    old = _per_combination(model, x_old, y_old, jobs)
    t_old = time.perf_counter() - start
    start = time.perf_counter()
    new = ablation_reports(model, x_new, y_new, jobs, channel_means(model, x_new))
    t_new = time.perf_counter() - start
    inside, total, gap, degenerate = 0, 0, 0.0, 0
    for o, n in zip(old, new):
        for path, a, b in _leaves(o, n):
            if path[-1] in SCORES and a is not None:
                half = _lookup(n, path[:-1])["ci95"][path[-1]]
                inside += abs(a - b) <= half
                total += 1
                gap = max(gap, abs(a - b))
                # an ablated model that predicts one class for (nearly) every image: its
                # scores jump with which class that is, not with the images sampled
                degenerate += abs(a - b) > half and max(_lookup(r, path[:-1])["max_predicted_fraction"]
                                                        for r in (o, n)) > DEGENERATE_FRACTION
    same = [a == b for o, n in zip(_per_combination(model, x_new, y_new, jobs), new)
            for path, a, b in _leaves(o, n) if path[-1] in SCORES and a is not None]
    print(f"ablations: per combination on 1000 images {t_old:.1f} s, batched on {len(y_new)} {t_new:.1f} s; "
          f"{inside}/{total} numbers inside the new 95% interval of the old ({degenerate} of those outside from "
          f"degenerate ablations), largest gap {gap:.3f}; "
          f"on the same {len(y_new)} images {sum(same)}/{len(same)} numbers equal")


SCORES = ("recall", "accuracy", "predicted_fraction", "max_predicted_fraction")


def _per_combination(model, x, y, jobs) -> list[dict]:
    """The old path: one hooked ``ablate`` pass per (circuit or random, mode, fill), with
    the means of ``x``."""
    means = channel_means(model, x)
    base = predict(model, x)
    return [{"baseline": _scores(base, y, c, 10), **{
        label: {mode: {fill: _scores(ablate(model, x, m, mode, fill, means), y, c, 10) for fill in ("zero", "mean")}
                for mode in MODES}
        for label, m in (("circuit", mask), ("random", rnd))}} for c, mask, rnd in jobs]


def _leaves(a, b, path=()):
    if isinstance(a, dict):
        for k in a:
            if k != "ci95":
                yield from _leaves(a[k], b[k], (*path, k))
    else:
        yield path, a, b


def _lookup(d, path):
    for k in path:
        d = d[k]
    return d


def probe(model, data) -> None:
    g = torch.Generator().manual_seed(2)
    audit = torch.randperm(len(data.y_train), generator=g)[:1000]
    x_audit, y_audit = data.x_train[audit], data.y_train[audit]
    diag = Misalignment(MisalignmentConfig())
    splits = diag._splits(y_audit, 10, 0)
    accuracy = {}
    for name, extract in (("model as it is", _plain_features), ("channels-last copy", features)):
        f_audit, f_test = extract(model, x_audit), extract(model, data.x_test)
        accuracy[name] = diag._probe(f_audit, y_audit, f_test, data.y_test, splits, 10, 0)["accuracy"]
    diff = 100 * (accuracy["channels-last copy"] - accuracy["model as it is"])
    print(f"probe accuracy {accuracy}, difference {diff:+.2f} points")


@torch.no_grad()
def _plain_features(model, x):
    return torch.cat([model.forward_features(b) for b in x.split(1000)]).float()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--channels", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--samples", type=int, default=6000, help="training images of the checkpoint")
    parser.add_argument("--sparsity", type=float, default=0.999, help="the paper's pruning (0: dense)")
    parser.add_argument("--steps", type=int, default=300, help="gate steps (at most)")
    parser.add_argument("--ablation-samples", type=int, default=500, help="the diagnostic's default")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--npz", default=None, help="CIFAR-10 .npz (default: the project's search path)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    data = load_dataset("cifar10", CIFAR10Config(npz=args.npz))
    model, client = checkpoint(data, args.channels, args.samples, args.sparsity)
    masks = circuits(model, data.x_train[client], data.y_train[client], args.steps)
    ablations(model, data, masks, args.ablation_samples)
    probe(model, data)


if __name__ == "__main__":
    main()

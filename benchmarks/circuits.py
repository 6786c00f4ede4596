"""Circuit discovery: all classes at once (one gate row per class) vs one class at a time.

SimpleCNN [64, 128, 256] on synthetic 28x28 one-channel data with 10 classes, briefly
trained. The one-class runs follow the paper: ``--batch-size`` samples of one class per
step, class after class. The vectorised run shares one ``--batch-size`` step among all
classes (ceil(batch/10) samples of each), so it costs about one class's run. Prints both
times, the speed-up, and how much the two sets of circuits agree (mean IoU).

    python benchmarks/circuits.py [--steps 100] [--batch-size 256] [--channels 64 128 256] [--all-steps]

The paper's setting: ``--steps 300 --all-steps`` (no early stop) at batch 256.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from fedmech_flwr.builtin.diagnostics.circuits.discovery import discover_circuits, discover_one_class
from fedmech_flwr.builtin.diagnostics.circuits.gates import GateConfig
from fedmech_flwr.builtin.diagnostics.circuits.metrics import circuit_iou
from fedmech_flwr.datasets.data import SyntheticConfig, load_dataset
from fedmech_flwr.models import build_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=256, help="samples per step")
    parser.add_argument("--channels", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--max-batch", type=int, default=256, help="samples per forward pass")
    parser.add_argument("--train-steps", type=int, default=30)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--all-steps", action="store_true",
                        help="every class runs all --steps (the authors' code's protocol; default: the early stop)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)

    data = load_dataset("synthetic", SyntheticConfig(num_train=2000, num_test=10, image_size=28))
    model = build_model(
        "simple_cnn", {"channels": args.channels}, in_channels=1, num_classes=10, image_size=28
    ).to(device)
    x, y = data.x_train.to(device), data.y_train.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(args.train_steps):
        idx = torch.randint(len(x), (64,), device=device)
        optimizer.zero_grad()
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        optimizer.step()

    cfg = GateConfig(steps=args.steps, batch_size=args.batch_size, max_batch=args.max_batch,
                     patience=None if args.all_steps else GateConfig.patience)
    classes = list(range(10))
    discover_one_class(model, x, y, 0, GateConfig(steps=2, batch_size=8), torch.Generator())  # warm-up

    def timed(fn):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return out, time.perf_counter() - start

    together, t_vec = timed(lambda: discover_circuits(model, x, y, classes, cfg, torch.Generator().manual_seed(0)))
    alone, t_loop = timed(lambda: {
        c: discover_one_class(model, x, y, c, cfg, torch.Generator().manual_seed(0)) for c in classes
    })
    agreement = sum(circuit_iou(together[c], alone[c]) for c in classes) / len(classes)
    print(
        f"SimpleCNN {args.channels}, 10 classes, {args.steps} steps, batch {args.batch_size}, "
        f"max batch {args.max_batch}, {'all steps' if args.all_steps else 'early stop'}, {device}, "
        f"{args.threads} threads"
    )
    print(f"vectorised (10 classes share each step): {t_vec:8.2f} s")
    print(f"10 one-class runs (the authors' code's):  {t_loop:8.2f} s")
    print(f"speed-up:                                 {t_loop / t_vec:8.2f} x")
    print(f"mean circuit IoU, vectorised vs one-class: {agreement:.3f}")


if __name__ == "__main__":
    main()

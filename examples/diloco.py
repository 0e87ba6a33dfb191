"""DiLoCo and Streaming DiLoCo on examples/train.py's DigitsCNN (scikit-learn's 8x8 digits).

    mpirun -n 4 python examples/diloco.py                               # DiLoCo, H = 10
    mpirun -n 4 python examples/diloco.py --sync-every 50
    mpirun -n 4 python examples/diloco.py --sync-every 12 --fragments 4 --overlap 1 \
        --compression int4                                    # Streaming DiLoCo (F divides H)

Each rank trains its own replica with the inner optimizer (SGD with momentum, as
examples/train.py) on its shard of every epoch; every ``--sync-every`` inner steps each
fragment's pseudo-gradient (global parameters minus this rank's) is averaged over the ranks
and the outer optimizer (SGD with Nesterov momentum, the DiLoCo paper's lr 0.7; momentum
0.5 here, as the paper's 0.9 diverged with H = 10, ``--outer-momentum``) steps the global parameters with it (:class:`mpicoll.torch.DiLoCo`,
docs/diloco.md). ``--fragments F`` syncs the model in ``F`` pieces ``H / F`` steps apart,
``--overlap T`` lets each all-reduce run during the next ``T`` inner steps (the arriving
fragment is then ``lerp(global, local, --alpha)``), ``--compression`` sends the
pseudo-gradients through a codec with error feedback (``int4``, ``int8``, ``fp16`` ...).

Rank 0 prints, per epoch, the mean training loss and the test accuracy of the *global*
parameters, and at the end the bytes this rank's pseudo-gradient all-reduces sent.
``--json FILE`` writes the run's record (loss and accuracy against training time and
bytes). The script exits with status 1 if the final accuracy is below ``--min-accuracy``.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from train import DigitsCNN, evaluate, hvd, load_data, shard, train_epoch  # noqa: E402


def global_model(diloco: hvd.DiLoCo, scratch: torch.nn.Module) -> torch.nn.Module:
    """``scratch`` holding DiLoCo's global parameters (the same on every rank)."""
    with torch.no_grad():
        for p, theta in zip(scratch.parameters(), diloco.global_parameters()):
            p.copy_(theta)
    return scratch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch", type=int, default=64, help="global batch (split over ranks)")
    parser.add_argument("--lr", type=float, default=0.05, help="inner SGD learning rate")
    parser.add_argument("--momentum", type=float, default=0.9, help="inner SGD momentum")
    parser.add_argument("--outer-lr", type=float, default=0.7)
    parser.add_argument("--outer-momentum", type=float, default=0.5,
                        help="Nesterov momentum of the outer SGD (the paper: 0.9; here 0.9 "
                             "with H = 10 and the inner momentum 0.9 diverged)")
    parser.add_argument("--sync-every", type=int, default=10, metavar="H")
    parser.add_argument("--fragments", type=int, default=1, metavar="F")
    parser.add_argument("--overlap", type=int, default=0, metavar="T")
    parser.add_argument("--alpha", type=float, default=0.5)
    parser.add_argument("--compression", default=None,
                        help="codec of the pseudo-gradients: int4, int8, fp16, bf16, ...")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--dataset", choices=("digits", "synthetic"), default="digits")
    parser.add_argument("--min-accuracy", type=float, default=0.9)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--json", default=None, help="rank 0 writes the run's record here")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    hvd.init()
    per_rank = max(1, args.batch // hvd.size())
    xtr, ytr, xte, yte, desc = load_data(args.dataset)
    torch.manual_seed(args.seed)
    model = DigitsCNN()
    inner = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    outer = torch.optim.SGD(model.parameters(), lr=args.outer_lr,
                            momentum=args.outer_momentum, nesterov=args.outer_momentum > 0)
    try:
        diloco = hvd.DiLoCo(model, inner, outer, sync_every=args.sync_every,
                            fragments=args.fragments, overlap=args.overlap, alpha=args.alpha,
                            compression=args.compression)
    except (TypeError, ValueError) as exc:     # raised on every rank alike
        if hvd.rank() == 0:
            print(f"diloco.py: {exc}", file=sys.stderr, flush=True)
        hvd.shutdown()
        return 2
    scratch = copy.deepcopy(model)
    if hvd.rank() == 0:
        print(f"data: {desc}; model: {sum(p.numel() for p in model.parameters())} parameters "
              f"in fragments of {diloco.stats()['fragments']}; {hvd.size()} ranks x batch "
              f"{per_rank}; H={args.sync_every} F={args.fragments} tau={args.overlap} "
              f"alpha={args.alpha} compression={args.compression}; all-reduce "
              f"{diloco.algorithm}", flush=True)
    started = time.perf_counter()
    train_seconds, log = 0.0, []
    for epoch in range(args.epochs):
        mean_loss, _, _, seconds = train_epoch(model, diloco, xtr, ytr,
                                               shard(len(ytr), epoch, args.seed), per_rank)
        train_seconds += seconds
        accuracy = evaluate(global_model(diloco, scratch), xte, yte)
        sent = diloco.stats()["bytes_sent"]
        log.append([round(train_seconds, 4), epoch + 1, diloco.steps, mean_loss, accuracy,
                    sent["total"], sent["inter_node"]])
        if hvd.rank() == 0:
            print(f"epoch {epoch + 1:3d}/{args.epochs}  loss {mean_loss:.4f}  test accuracy "
                  f"(global parameters) {accuracy:.4f}  outer steps "
                  f"{diloco.stats()['outer_steps']}  ({time.perf_counter() - started:.1f} s)",
                  flush=True)
    stats = diloco.stats()
    diloco.close()
    accuracy = evaluate(global_model(diloco, scratch), xte, yte)
    if hvd.rank() == 0:
        dense = 2 * (hvd.size() - 1) * sum(p.numel() * p.element_size()
                                           for p in model.parameters()) // hvd.size()
        print(f"final test accuracy (global parameters): {accuracy:.4f}; {stats['steps']} "
              f"inner steps in {train_seconds:.2f} s; rank 0 sent "
              f"{stats['bytes_sent']['total']} bytes for its pseudo-gradients "
              f"({stats['bytes_sent']['total'] / max(stats['steps'], 1):.0f} per step; "
              f"every-step sync as a ring: {dense} per step)", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"ranks": hvd.size(), "sync_every": args.sync_every,
                           "fragments": args.fragments, "overlap": args.overlap,
                           "alpha": args.alpha, "compression": args.compression,
                           "epochs": args.epochs, "seed": args.seed, "batch": args.batch,
                           "dataset": desc, "final_accuracy": accuracy, **stats,
                           "train_seconds": train_seconds,
                           "log_columns": ["train_seconds", "epoch", "inner_steps", "loss",
                                           "accuracy", "bytes_sent", "inter_node_bytes"],
                           "log": log}, f, indent=1)
    hvd.shutdown()
    return 0 if accuracy >= args.min_accuracy and math.isfinite(accuracy) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Data-parallel training of a small CNN on scikit-learn's bundled 8x8 digits (no download),
with mpicoll.torch in place of horovod.torch.

    mpirun -n 4 python examples/train.py                       # 1, 2, 4, 8 ... ranks
    mpirun -n 4 python examples/train.py --epochs 20 --checkpoint-dir ckpt
    mpirun -n 4 python examples/train.py --epochs 30 --checkpoint-dir ckpt --resume
    mpirun -n 4 python examples/train.py --compression int8      # or onebit, topk:0.01 ...

The global batch (``--batch``) is split evenly over the ranks (``batch // ranks`` each, at
least 1: the header line shows the batch run), so the same hyperparameters train the same
way at any world size. Every epoch each rank takes its shard of one shared
permutation (padded so that every rank runs the same number of steps); rank 0 prints the
loss and test accuracy (averaged over ranks) and writes a checkpoint that ``--resume``
restores (parameters, optimizer state and epoch, broadcast from rank 0). The script exits
with status 1 if the final test accuracy is below ``--min-accuracy``.

``--compression`` picks the gradient compressor: Horovod's ``none`` (default) and ``fp16``,
or mpicoll's codecs ``bf16``, ``int8``, ``onebit``, ``topk:RATIO``, ``randomk:RATIO`` (with
error feedback unless ``--no-error-feedback``; onebit compresses each rank's local
momentum instead of its gradient, ``--compress-momentum``; ``--compress-warmup N`` (optimizer
steps) or ``Nep`` (epochs) runs the first steps uncompressed, as 1-bit Adam's warm-up).
With ``--checkpoint-dir`` every rank also saves its compression state (residuals, local
momentum, step count) as ``compression.<rank>.pt``, which ``--resume`` restores at the same
world size. ``--lr-schedule`` sets the learning rate per optimizer step: ``constant``
(default), ``cosine`` (from ``--lr`` down to 0 over the run, ``lr (1 + cos(pi t/T)) / 2``
at step ``t`` of ``T``) or ``step`` (``--lr``, then a tenth from half of the epochs on and
a hundredth from three quarters on). ``--flush-residuals`` (codec compressors with error
feedback) ends training with one uncompressed all-reduce of the ranks' residuals, applied
to the parameters (:func:`flush_residuals`). ``--json FILE`` makes rank 0
write the run's record: loss against training wall time per epoch, final accuracy, samples
per second and the bytes rank 0 sent per step.

``--elastic`` trains with Horovod's elastic API (``hvd.elastic.run``, ``TorchState``,
``ElasticSampler``; docs/elastic.md): under Open MPI with ULFM a rank that dies is dropped
and the survivors go on from the last commit (``--commit-every`` steps; ``--min-np`` the
fewest ranks to go on with), and ``--kill-rank R --kill-step S`` makes rank R SIGKILL
itself before step S, to try it::

    mpirun --with-ft ulfm --oversubscribe -n 4 python examples/train.py --elastic \
        --kill-rank 2 --kill-step 30

Rank 0 then prints when the first step after the failure completed, the recovery's
phases, and the mean cost of a commit. ``--elastic --ddp`` trains a
``DistributedDataParallel`` module over the "mpicoll" ``torch.distributed`` backend
instead, without ``hvd.init()``: the process group is rebuilt in place on the survivors. The per-rank batch stays fixed (the global batch
shrinks with the world); compression, checkpoints and learning-rate schedules are not
combined with ``--elastic``.

Without scikit-learn (``pip install scikit-learn``) it falls back to a synthetic 10-class
task of the same shape (``--dataset synthetic``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import mpicoll.torch as hvd  # noqa: E402  (the only line that differs from a Horovod script)
from mpicoll.torch.elastic import world as layout  # noqa: E402  (hvd's, or the world's: --ddp)


class DigitsCNN(nn.Module):
    """conv(1->16) pool conv(16->32) pool fc(128->64) fc(64->10) on 1x8x8 images."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 2 * 2, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def load_data(kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, str]:
    """(train x, train y, test x, test y, description); the same split on every rank."""
    if kind == "digits":
        try:
            from sklearn.datasets import load_digits
        except ImportError:
            kind = "synthetic"
        else:
            digits = load_digits()
            x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
            y = torch.tensor(digits.target, dtype=torch.int64)
            desc = "scikit-learn digits (1797 8x8 images)"
    if kind == "synthetic":
        g = torch.Generator().manual_seed(0)
        centers = torch.rand(10, 1, 8, 8, generator=g)
        y = torch.randint(0, 10, (1800,), generator=g)
        x = (centers[y] + 0.35 * torch.randn(1800, 1, 8, 8, generator=g)).clamp(0, 1)
        desc = "synthetic 10-class 8x8 blobs (1800 samples)"
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(42))
    x, y = x[perm], y[perm]
    cut = int(0.8 * len(y))
    return x[:cut], y[:cut], x[cut:], y[cut:], desc


def shard(n_items: int, epoch: int, seed: int) -> torch.Tensor:
    """This rank's indices for ``epoch``: a shared permutation, padded, every size-th item."""
    perm = torch.randperm(n_items, generator=torch.Generator().manual_seed(seed + epoch))
    total = math.ceil(n_items / hvd.size()) * hvd.size()
    perm = torch.cat([perm, perm[:total - n_items]])
    return perm[hvd.rank()::hvd.size()]


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Test accuracy over the whole test set (each rank scores its slice)."""
    model.eval()
    with torch.no_grad():
        mine = slice(layout.rank(), None, layout.size())
        correct = (model(x[mine]).argmax(1) == y[mine]).sum()
    model.train()
    total = torch.tensor([float(correct), float(len(y[mine]))])
    if layout.hvd_started():
        total = hvd.allreduce(total, op=hvd.Sum, name="eval.correct")
    else:                                  # --elastic --ddp: no hvd.init()
        dist.all_reduce(total)
    return float(total[0] / total[1])


def train_step(model: nn.Module, optimizer: Any, x: torch.Tensor, y: torch.Tensor,
               idx: torch.Tensor) -> torch.Tensor:
    """One ``optimizer`` step on the cross-entropy of ``model`` over the batch ``x[idx]``
    (labels ``y[idx]``); ``optimizer`` is anything with ``zero_grad()`` and ``step()`` (a
    torch optimizer, the ``DistributedOptimizer``, :class:`mpicoll.torch.DiLoCo`).

    Returns:
        The batch's loss.
    """
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x[idx]), y[idx])
    loss.backward()
    optimizer.step()
    return loss


def train_epoch(model: nn.Module, optimizer: Any, x: torch.Tensor,
                y: torch.Tensor, indices: torch.Tensor, per_rank: int,
                before_step: Callable[[int], None] | None = None
                ) -> tuple[float, int, int, float]:
    """One epoch of :func:`train_step` over this rank's ``indices`` (from :func:`shard`) in
    batches of ``per_rank``.

    Args:
        before_step: called before each step with the batch's number in the epoch (to set
            the learning rate).
    Returns:
        ``(loss, batches, samples, seconds)``: this rank's mean batch loss averaged over
        the ranks, the steps and samples this rank ran, and the wall time of the steps
        (without the loss's all-reduce).
    """
    total_loss, batches, samples = 0.0, 0, 0
    start = time.perf_counter()
    for i in range(0, len(indices), per_rank):
        idx = indices[i:i + per_rank]
        if before_step is not None:
            before_step(i // per_rank)
        loss = train_step(model, optimizer, x, y, idx)
        total_loss += float(loss.detach())
        batches += 1
        samples += len(idx)
    seconds = time.perf_counter() - start
    mean_loss = float(hvd.allreduce(torch.tensor(total_loss / batches), name="epoch.loss"))
    return mean_loss, batches, samples, seconds


CODEC_NAMES = ("bf16", "int8", "onebit")


def compressor(spec: str, feedback: bool = True, momentum: float = 0.0,
               warmup: int = 0) -> object:
    """The ``hvd.Compression`` object for ``--compression`` ``spec`` (codecs: compressing
    the ranks' local momentum ``m = momentum m + g`` when ``momentum`` > 0, the first
    ``warmup`` optimizer steps uncompressed).

    Raises:
        argparse.ArgumentTypeError: an unknown name or a bad ratio; a warm-up with
            ``none`` or ``fp16``.
    """
    name, _, ratio = spec.partition(":")
    try:
        if name in ("none", "fp16") and not ratio:
            if warmup:
                raise ValueError("a warm-up needs a codec compressor")
            return getattr(hvd.Compression, name)
        if name in CODEC_NAMES:          # with options: "int8:512:stochastic", "onebit:64"
            return hvd.Compression.from_codec(spec, feedback, momentum, warmup)
        if name in ("topk", "randomk") and ratio:
            return getattr(hvd.Compression, name)(float(ratio), feedback=feedback,
                                                  momentum=momentum, warmup=warmup)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--compression {spec}: {exc}") from None
    raise argparse.ArgumentTypeError(
        f"--compression {spec!r}: choose none, fp16, {', '.join(CODEC_NAMES)}, topk:RATIO or "
        f"randomk:RATIO")


def warmup_steps(value: str, steps_per_epoch: int) -> int:
    """``--compress-warmup``: ``N`` optimizer steps, or ``Nep`` epochs of
    ``steps_per_epoch`` steps.

    Raises:
        argparse.ArgumentTypeError: neither form, or negative.
    """
    epochs = value.endswith("ep")
    try:
        count = int(value[:-2] if epochs else value)
    except ValueError:
        count = -1
    if count < 0:
        raise argparse.ArgumentTypeError(f"--compress-warmup {value!r}: give N (optimizer "
                                         f"steps) or Nep (epochs), N >= 0")
    return count * steps_per_epoch if epochs else count


LR_SCHEDULES = ("constant", "cosine", "step")


def learning_rate(schedule: str, lr: float, step: int, total_steps: int) -> float:
    """The learning rate of optimizer step ``step`` (from 0) of ``total_steps``.

    Raises:
        ValueError: an unknown schedule.
    """
    frac = step / max(total_steps, 1)
    if schedule == "constant":
        return lr
    if schedule == "cosine":
        return lr * 0.5 * (1.0 + math.cos(math.pi * frac))
    if schedule == "step":
        return lr * (1.0 if frac < 0.5 else 0.1 if frac < 0.75 else 0.01)
    raise ValueError(f"unknown learning-rate schedule {schedule!r}; choose from "
                     f"{', '.join(LR_SCHEDULES)}")


def flush_residuals(optimizer: object, model: nn.Module, lr: float, factor: float) -> int:
    """Apply what error feedback still holds back: the ranks' residuals ``e_r`` (one
    all-reduce, uncompressed, averaged: ``e``), the parameters moved by ``-lr factor e``;
    the residuals then start again from zero. Returns the bytes this rank sent (counted as
    a ring would send them).

    With the local momentum compressed (or no momentum) the parameters after the step
    ``x - lr M`` are ``x~ - lr e`` where ``x~`` follows the uncompressed update (the sent
    values add up to the inputs minus the residuals), so ``factor = 1`` moves them to
    ``x~`` exactly; with the gradients compressed and the optimizer's momentum ``beta``
    applied after, the offset approaches ``lr e / (1 - beta)`` (``factor = 1/(1 -
    beta)``). This is error reset (CSER, Xie et al. 2020) done once, at the end.
    """
    feedback = optimizer.error_feedback
    named = [(name, p) for name, p in model.named_parameters()]
    flat = torch.cat([torch.from_numpy(feedback.residual(name).copy())
                      if feedback.residual(name) is not None else torch.zeros(p.numel())
                      for name, p in named])
    mean = hvd.allreduce(flat, op=hvd.Average, name="flush.residuals")
    offset = 0
    with torch.no_grad():
        for name, p in named:
            p.sub_(mean[offset:offset + p.numel()].view_as(p).to(p.dtype), alpha=lr * factor)
            offset += p.numel()
    feedback.reset()
    return 2 * (hvd.size() - 1) * flat.numel() * flat.element_size() // hvd.size()


def bytes_per_step(optimizer: object, model: nn.Module, spec: str) -> tuple[int, int]:
    """(bytes this rank sent for the latest step's gradients, bytes uncompressed).

    Codec compressors report what their compressed all-reduces sent; ``none`` and ``fp16``
    go through the engine's all-reduce, counted as a ring would send them (``2 (n-1)/n``
    of the gradients, at 2 bytes per value for fp16)."""
    stats = optimizer.compression_stats
    if stats:
        return sum(s.bytes_sent for s in stats), sum(s.dense_bytes for s in stats)
    n = hvd.size()
    dense = 2 * (n - 1) * sum(p.numel() * p.element_size() for p in model.parameters()) // n
    return (dense // 2 if spec == "fp16" else dense), dense


def save_compression(optimizer: object, folder: str) -> None:
    """Every rank writes its compression state (codec compressors only) to
    ``folder/compression.<rank>.pt``; it differs per rank, so it is not in rank 0's
    checkpoint."""
    state = optimizer.compression_state_dict()
    if state:
        os.makedirs(folder, exist_ok=True)
        mine = os.path.join(folder, f"compression.{hvd.rank()}.pt")
        torch.save(state, mine + ".tmp")
        os.replace(mine + ".tmp", mine)


def restore_compression(optimizer: object, folder: str, saved_ranks: int) -> None:
    """Load this rank's :func:`save_compression` file when the checkpoint was written at
    this world size (every rank decides alike); otherwise residuals, local momentum and the
    warm-up's step count start again from zero."""
    mine = os.path.join(folder, f"compression.{hvd.rank()}.pt")
    if saved_ranks == hvd.size() and optimizer.compression_state_dict():
        if os.path.exists(mine):
            optimizer.load_compression_state_dict(torch.load(mine, weights_only=True))
    elif hvd.rank() == 0 and saved_ranks != hvd.size():
        print(f"checkpoint written by {saved_ranks} ranks: compression state not restored",
              flush=True)


def train_elastic(args: argparse.Namespace, model: nn.Module, optimizer: torch.optim.Optimizer,
                  xtr: torch.Tensor, ytr: torch.Tensor, xte: torch.Tensor,
                  yte: torch.Tensor) -> tuple[float, dict]:
    """``--elastic``: train with ``hvd.elastic`` (``--ddp``: a DDP module over the "mpicoll"
    process group, without ``hvd.init()``); return (final accuracy, a record of the
    commits and resets)."""
    per_rank = max(1, args.batch // layout.size())
    if args.ddp:          # DDP over "mpicoll" (docs/elastic.md, DDP): no hvd.init()
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        optimizer = hvd.DistributedOptimizer(optimizer,
                                             named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(range(len(ytr)), shuffle=True, seed=args.seed)
    # per_rank is state: ranks that join a grown job take the running ranks' batch
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, step=0,
                                   per_rank=per_rank)
    me = layout.rank()                              # the launch rank (for --kill-rank)
    record: dict = {"commit_seconds": [], "resets": []}
    pending = {"reset": False}
    seen = {"growth": hvd.elastic.last_growth()}   # a process that joined: its own join

    def on_reset() -> None:
        pending["reset"] = True
        record["resets"].append({"size": layout.size(), "time": time.time()})

    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run(min_np=args.min_np)
    def train(state: hvd.elastic.TorchState) -> None:
        while state.epoch < args.epochs:
            indices = list(state.sampler)
            per_rank = state.per_rank
            for i in range(0, len(indices), per_rank):
                if (me == args.kill_rank and state.step == args.kill_step
                        and os.environ.get("MPICOLL_ELASTIC_RESTART", "0") == "0"):
                    # the first launch only: a relaunched job (the supervisor) goes on
                    print(f"rank {me}: SIGKILL at {time.time():.6f}", flush=True)
                    os.kill(os.getpid(), 9)
                idx = torch.tensor(indices[i:i + per_rank], device=xtr.device)
                state.optimizer.zero_grad()
                F.cross_entropy(state.model(xtr[idx]), ytr[idx]).backward()
                state.optimizer.step()
                state.step += 1
                state.sampler.record_batch(i // per_rank, per_rank)
                if state.step % args.commit_every == 0:
                    began = time.perf_counter()
                    state.commit()
                    record["commit_seconds"].append(time.perf_counter() - began)
                if pending["reset"] and hvd.elastic.last_growth() is not seen["growth"]:
                    pending["reset"] = False             # the world grew (discovery)
                    growth = seen["growth"] = hvd.elastic.last_growth()
                    record["resets"][-1].update(first_step=time.time(),
                                                grew_from=growth.old_size, **growth.phases)
                    if layout.rank() == 0:
                        print(f"{layout.size()} ranks go on: grown from {growth.old_size}, "
                              f"first step done at {time.time():.6f}; {growth.summary()}",
                              flush=True)
                if pending["reset"] and hvd.elastic.last_recovery() is not None:
                    pending["reset"] = False
                    rec = hvd.elastic.last_recovery()
                    record["resets"][-1].update(
                        first_step=time.time(), detected=rec.detected_at, failed=rec.failed,
                        revoke=rec.revoke_s, shrink=rec.shrink_s, **rec.phases)
                    if layout.rank() == 0:
                        print(f"{layout.size()} ranks go on: failure caught at "
                              f"{rec.detected_at:.6f}, first step after it done at "
                              f"{time.time():.6f}; failed {rec.failed}; revoke "
                              f"{rec.revoke_s:.4f} s, shrink {rec.shrink_s:.4f} s, "
                              + ", ".join(f"{k} {v:.4f} s" for k, v in rec.phases.items()),
                              flush=True)
            # the epoch advances before the commit, with the sampler (Horovod's example):
            # a job restored from this commit starts the next epoch, not this one again
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            state.commit()
            accuracy = evaluate(state.model, xte, yte)
            if layout.rank() == 0:
                print(f"epoch {state.epoch:3d}/{args.epochs}  test accuracy "
                      f"{accuracy:.4f}  ({layout.size()} ranks)", flush=True)

    train(state)
    commits = record["commit_seconds"]
    if layout.rank() == 0 and commits:
        print(f"commit: {len(commits)} x, mean {1e3 * sum(commits) / len(commits):.3f} ms "
              f"(deep copies of {sum(p.numel() for p in model.parameters())} parameters "
              f"and the optimizer state)", flush=True)
    return evaluate(model, xte, yte), record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch", type=int, default=64, help="global batch (split over ranks)")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--lr-schedule", choices=LR_SCHEDULES, default="constant",
                        help="constant (default), cosine (down to 0 over the run) or step "
                             "(x0.1 at half of the epochs, x0.01 at three quarters)")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--dataset", choices=("digits", "synthetic"), default="digits")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="write checkpoint.pt here every epoch (rank 0)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from --checkpoint-dir/checkpoint.pt if it exists")
    parser.add_argument("--min-accuracy", type=float, default=0.9,
                        help="exit with status 1 below this final test accuracy")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (>= 1)")
    parser.add_argument("--compression", default="none",
                        help="none (default), fp16, bf16, int8[:CHUNK][:stochastic], "
                             "onebit[:CHUNK], topk:RATIO, randomk:RATIO")
    parser.add_argument("--no-error-feedback", action="store_true",
                        help="codec compressors without error feedback")
    parser.add_argument("--compress-momentum", choices=("auto", "yes", "no"), default="auto",
                        help="codec compressors: compress each rank's local momentum "
                             "instead of its gradient (Compression...with_momentum); auto: "
                             "yes for onebit, no for the others")
    parser.add_argument("--compress-warmup", default="0", metavar="N|Nep",
                        help="codec compressors: run the first N optimizer steps (Nep: N "
                             "epochs) uncompressed, then compress (Compression..."
                             "with_warmup)")
    parser.add_argument("--flush-residuals", action="store_true",
                        help="codec compressors with error feedback: after the last step, "
                             "apply the ranks' averaged residuals to the parameters (one "
                             "uncompressed all-reduce)")
    parser.add_argument("--json", default=None, help="rank 0 writes the run's record here")
    parser.add_argument("--elastic", action="store_true",
                        help="train with hvd.elastic (go on after a rank dies; ULFM)")
    parser.add_argument("--ddp", action="store_true",
                        help="--elastic: train a DDP module over the \"mpicoll\" "
                             "torch.distributed backend (no hvd.init())")
    parser.add_argument("--min-np", type=int, default=1,
                        help="--elastic: the fewest ranks to go on with")
    parser.add_argument("--commit-every", type=int, default=1,
                        help="--elastic: commit the state every N steps")
    parser.add_argument("--kill-rank", type=int, default=-1,
                        help="--elastic: this rank SIGKILLs itself (fault injection)")
    parser.add_argument("--kill-step", type=int, default=-1,
                        help="--elastic: ... before this step")
    parser.add_argument("--device", default="cpu",
                        help="cpu (default), cuda (each rank on GPU local_rank %% count) or "
                             "cuda:N: where the model, data and gradients live")
    args = parser.parse_args()
    if args.threads < 1:
        parser.error(f"--threads must be >= 1, not {args.threads}")
    torch.set_num_threads(args.threads)
    if args.ddp and not args.elastic:
        parser.error("--ddp goes with --elastic")
    if args.ddp:
        dist.init_process_group("mpicoll")
    else:
        hvd.init()
    per_rank = max(1, args.batch // layout.size())
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())
    xtr, ytr, xte, yte, desc = (v.to(device) if isinstance(v, torch.Tensor) else v
                                for v in load_data(args.dataset))
    steps_per_epoch = math.ceil(math.ceil(len(ytr) / layout.size()) / per_rank)
    try:
        compress_momentum = args.momentum > 0 and args.compression.split(":")[0] in \
            CODEC_NAMES + ("topk", "randomk") and (
                args.compress_momentum == "yes" or
                (args.compress_momentum == "auto" and args.compression.startswith("onebit")))
        warmup = warmup_steps(args.compress_warmup, steps_per_epoch)
        compression = compressor(args.compression, not args.no_error_feedback,
                                 args.momentum if compress_momentum else 0.0, warmup)
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    if args.flush_residuals and (args.compression.split(":")[0] in ("none", "fp16")
                                 or args.no_error_feedback):
        parser.error("--flush-residuals needs a codec compressor with error feedback")
    torch.manual_seed(args.seed)
    model = DigitsCNN().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    if args.elastic:
        if args.compression != "none" or args.checkpoint_dir or args.lr_schedule != "constant":
            parser.error("--elastic is not combined with --compression, --checkpoint-dir "
                         "or --lr-schedule")
        accuracy, record = train_elastic(args, model, optimizer, xtr, ytr, xte, yte)
        if layout.rank() == 0:
            print(f"final test accuracy: {accuracy:.4f} ({layout.size()} ranks)", flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"elastic": True, "ddp": args.ddp, "ranks": layout.size(),
                               "epochs": args.epochs,
                               "final_accuracy": accuracy, **record}, f, indent=1)
        if args.ddp:
            dist.destroy_process_group()
        else:
            hvd.shutdown()
        return _verdict(accuracy, args.min_accuracy)
    start_epoch, saved_ranks = 0, None
    path = os.path.join(args.checkpoint_dir, "checkpoint.pt") if args.checkpoint_dir else None
    if args.resume:
        if path is None:
            parser.error("--resume needs --checkpoint-dir")
        state = None
        if hvd.rank() == 0 and os.path.exists(path):
            state = torch.load(path, weights_only=True)
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
        start_epoch, saved_ranks = hvd.broadcast_object(
            (state["epoch"], state.get("ranks")) if state else (0, None), root_rank=0)
    # Everyone starts from rank 0's parameters and optimizer state.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression)
    if saved_ranks is not None:
        restore_compression(optimizer, args.checkpoint_dir, saved_ranks)

    if hvd.rank() == 0:
        print(f"data: {desc}; model: {sum(p.numel() for p in model.parameters())} parameters; "
              f"{hvd.size()} ranks x batch {per_rank}; epochs {start_epoch}..{args.epochs}; "
              f"compression {args.compression}"
              f"{' without error feedback' if args.no_error_feedback else ''}"
              f"{' (local momentum compressed)' if compress_momentum else ''}"
              f"{f', the first {warmup} steps uncompressed' if warmup else ''}"
              f"{f'; {args.lr_schedule} learning rate' if args.lr_schedule != 'constant' else ''}",
              flush=True)

    def scheduled_lr(batch: int) -> None:     # not with constant: the optimizer's own lr
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(args.lr_schedule, args.lr,
                                        epoch * steps_per_epoch + batch,
                                        args.epochs * steps_per_epoch)

    started = time.perf_counter()
    train_seconds, steps, mine, log = 0.0, 0, 0, []
    for epoch in range(start_epoch, args.epochs):
        indices = shard(len(ytr), epoch, args.seed).to(device)
        mean_loss, batches, samples, seconds = train_epoch(
            model, optimizer, xtr, ytr, indices, per_rank,
            scheduled_lr if args.lr_schedule != "constant" else None)
        train_seconds += seconds
        steps += batches
        mine += samples
        accuracy = evaluate(model, xte, yte)
        log.append([round(train_seconds, 4), epoch + 1, mean_loss, accuracy])
        if hvd.rank() == 0:
            print(f"epoch {epoch + 1:3d}/{args.epochs}  loss {mean_loss:.4f}  "
                  f"test accuracy {accuracy:.4f}  ({time.perf_counter() - started:.1f} s)",
                  flush=True)
            if path is not None:
                os.makedirs(args.checkpoint_dir, exist_ok=True)
                tmp = path + ".tmp"
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                            "epoch": epoch + 1, "ranks": hvd.size()}, tmp)
                os.replace(tmp, path)
        if path is not None:
            save_compression(optimizer, args.checkpoint_dir)
    accuracy = evaluate(model, xte, yte)
    sent, dense = bytes_per_step(optimizer, model, args.compression)
    before_flush, flush_bytes = None, 0
    if args.flush_residuals:
        last_lr = optimizer.param_groups[0]["lr"]
        flush_bytes = flush_residuals(optimizer, model, last_lr,
                                      1.0 if compress_momentum else 1.0 / (1.0 - args.momentum))
        before_flush, accuracy = accuracy, evaluate(model, xte, yte)
        if hvd.rank() == 0:
            print(f"residuals flushed ({flush_bytes} bytes): test accuracy {before_flush:.4f}"
                  f" -> {accuracy:.4f}", flush=True)
    if hvd.rank() == 0:
        print(f"final test accuracy: {accuracy:.4f} ({hvd.size()} ranks, "
              f"{time.perf_counter() - started:.1f} s training)", flush=True)
        samples = mine * hvd.size()           # every rank runs as many (padded) samples
        print(f"bytes sent per step by rank 0: {sent} (uncompressed {dense}); {samples} "
              f"samples in {train_seconds:.2f} s of steps: {samples / max(train_seconds, 1e-9):.0f}"
              f" samples/s", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"compression": args.compression,
                           "error_feedback": not args.no_error_feedback,
                           "compress_momentum": compress_momentum,
                           "compress_warmup": warmup, "lr_schedule": args.lr_schedule,
                           "flush_residuals": args.flush_residuals,
                           "accuracy_before_flush": before_flush, "flush_bytes": flush_bytes,
                           "ranks": hvd.size(), "epochs": args.epochs, "seed": args.seed,
                           "batch": args.batch, "dataset": desc,
                           "final_accuracy": accuracy, "steps": steps, "samples": samples,
                           "train_seconds": train_seconds,
                           "samples_per_second": samples / max(train_seconds, 1e-9),
                           "bytes_per_step": sent, "dense_bytes_per_step": dense,
                           "log": log}, f, indent=1)
    hvd.shutdown()
    return _verdict(accuracy, args.min_accuracy)


def _verdict(accuracy: float, minimum: float) -> int:
    """0 if ``accuracy`` reached ``minimum``; else 1, saying so (on stderr: the exit status
    alone, with mpirun's abort line, does not say why)."""
    if accuracy >= minimum:
        return 0
    print(f"final accuracy {accuracy:.4f} is below --min-accuracy {minimum}: exit status 1",
          file=sys.stderr, flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())

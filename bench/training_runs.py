"""The runner that the to-accuracy training benchmarks share (``bench.local_sgd``,
``bench.diloco``).

Both train ``examples/train.py``'s model on its data, one launch per seed with every
variant in it (the order rotated per seed), under ``MPICOLL_ALLREDUCE_ALGORITHM=ring``
(``MPICOLL_RANKS_PER_NODE`` from ``--ranks-per-node``); rank 0 of a launch writes its
records to the JSON file ``bench.bench_ps.launch_json`` hands it, and the launcher writes
``<--out>/<--name>.json``. This module holds those steps: the options they take alike,
the worker's set-up, the launches, the timed training loop and the result file.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time
from collections.abc import Callable
from typing import Any

from bench.bench_ps import launch_json
from bench.common import command_line, machine_description

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def add_run_options(p: argparse.ArgumentParser, *, variants: str, epochs: int) -> None:
    """Add the options of the launch and of the inner training: the worker's hidden
    ``--worker --variant --seed --json``, ``--ranks``, ``--ranks-per-node``,
    ``--variants`` (default ``variants``), ``--seeds``, ``--epochs`` (default ``epochs``),
    ``--batch``, ``--lr``, ``--momentum``."""
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", default="sync", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--json", default=None, help=argparse.SUPPRESS)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--ranks-per-node", type=int, default=2,
                   help="MPICOLL_RANKS_PER_NODE for the runs (0: the real node layout)")
    p.add_argument("--variants", default=variants)
    p.add_argument("--seeds", default="1,2")
    p.add_argument("--epochs", type=int, default=epochs)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)


def add_target_options(p: argparse.ArgumentParser, *, eval_every: int,
                       timeout: float) -> None:
    """Add ``--target`` (the test accuracy to reach), ``--eval-every`` (default
    ``eval_every``) and ``--timeout`` (seconds per launch; default ``timeout``)."""
    p.add_argument("--target", type=float, default=0.95)
    p.add_argument("--eval-every", type=int, default=eval_every)
    p.add_argument("--timeout", type=float, default=timeout)


def forwarded(a: argparse.Namespace, *names: str) -> list[str]:
    """``["--name", str(value), ...]``: the launcher's options ``names`` (as spelt on the
    command line, without the dashes) for the workers' command line."""
    return [arg for name in names
            for arg in (f"--{name}", str(getattr(a, name.replace("-", "_"))))]


def environment(a: argparse.Namespace) -> dict[str, str]:
    """The launches' environment: ring all-reduces, and ``MPICOLL_RANKS_PER_NODE`` unless
    ``--ranks-per-node 0``."""
    env = {"MPICOLL_ALLREDUCE_ALGORITHM": "ring"}
    if a.ranks_per_node:
        env["MPICOLL_RANKS_PER_NODE"] = str(a.ranks_per_node)
    return env


def train_module() -> Any:
    """``examples/train.py`` as a module (the model, data, shards and evaluation)."""
    spec = importlib.util.spec_from_file_location("train_example",
                                                  os.path.join(ROOT, "examples", "train.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def worker(a: argparse.Namespace, results: Callable[[Any, Any, tuple], Any],
           shutdown: bool = False) -> int:
    """One process of a launch (under mpirun): one torch thread, ``hvd.init()``, the
    digits; rank 0 writes ``results(train, hvd, data)`` to ``a.json``.

    Args:
        results: makes the launch's records from ``train`` (:func:`train_module`), ``hvd``
            (``mpicoll.torch``) and ``data`` (``train.load_data("digits")``).
        shutdown: call ``hvd.shutdown()`` at the end.
    Returns:
        0.
    """
    import torch

    train = train_module()
    hvd = train.hvd
    torch.set_num_threads(1)
    hvd.init()
    result = results(train, hvd, train.load_data("digits"))
    if hvd.rank() == 0:
        with open(a.json, "w") as f:
            json.dump(result, f)
    if shutdown:
        hvd.shutdown()
    return 0


def launch_seeds(a: argparse.Namespace, module: str, variants: list[str],
                 options: list[str], env: dict[str, str]) -> list[dict] | None:
    """One launch of ``python -m bench.<module> --worker`` on ``a.ranks`` ranks per seed of
    ``a.seeds``, every variant in it (the order rotated per seed), with the workers'
    ``options``; prints a line per record.

    Returns:
        The records, sorted by variant (in ``variants``' order) then seed; ``None`` if a
        launch failed.
    """
    records = []
    for i, seed in enumerate(int(s) for s in a.seeds.split(",")):
        order = variants[i % len(variants):] + variants[:i % len(variants)]  # rotate
        recs = launch_json(a.ranks, ["-m", f"bench.{module}", "--worker", "--variant",
                                     ",".join(order), "--seed", str(seed), *options],
                           f"seed {seed}", a.timeout, env)
        if recs is None:
            return None
        for rec in recs:
            print(f"{rec['variant']} seed {seed}: {rec['train_seconds']:.2f} s, final "
                  f"{rec['final_accuracy']:.4f}, reached {rec['reached']}", flush=True)
        records += recs
    records.sort(key=lambda r: (variants.index(r["variant"]), r["seed"]))
    return records


def train_to_target(train: Any, a: argparse.Namespace, seed: int, model: Any, opt: Any,
                    xtr: Any, ytr: Any, per_rank: int, evaluate: Callable[[], float], *,
                    columns: Callable[[int, list[float]], list] = lambda steps, losses: [],
                    reached_columns: tuple[int, ...] = ()
                    ) -> tuple[float, int, list, list | None]:
    """Train ``model`` with ``opt`` (``train.train_step``) for ``a.epochs`` epochs of this
    rank's shards of ``xtr``, ``ytr`` (``train.shard``, ``seed``) in batches of
    ``per_rank``, timing the steps only; every ``a.eval_every`` steps log the test
    accuracy and note when it first reaches ``a.target``.

    Args:
        evaluate: the test accuracy now.
        columns: the log row's further columns, given the step count and the losses since
            the previous row (called after ``evaluate``).
        reached_columns: the indices of the log row's columns that ``reached`` keeps.
    Returns:
        ``(training seconds, steps, log, reached)``: the log's rows are ``[step, seconds,
        accuracy, *columns]``; ``reached`` is ``[step, seconds]`` of the first row at or
        above ``a.target``, then its ``reached_columns`` (``None`` if there is none).
    """
    train_seconds, steps, log, reached, losses = 0.0, 0, [], None, []
    for epoch in range(a.epochs):
        indices = train.shard(len(ytr), epoch, seed)
        for i in range(0, len(indices), per_rank):
            idx = indices[i:i + per_rank]
            t0 = time.perf_counter()
            loss = train.train_step(model, opt, xtr, ytr, idx)
            train_seconds += time.perf_counter() - t0
            losses.append(float(loss.detach()))
            steps += 1
            if steps % a.eval_every == 0:
                accuracy = evaluate()
                log.append([steps, round(train_seconds, 4), accuracy,
                            *columns(steps, losses)])
                losses = []
                if reached is None and accuracy >= a.target:
                    reached = [steps, round(train_seconds, 4),
                               *(log[-1][k] for k in reached_columns)]
    return train_seconds, steps, log, reached


class WireBytes:
    """Bytes that this rank's node sent on the network interface ``iface`` (its
    ``/proc/net/dev`` transmit counter: frames as sent, IP and TCP headers included), all
    nodes summed, counting only while not paused: on the test bed (``cluster/``) each node
    is a network namespace whose ``eth0`` carries exactly what leaves the node (to the other
    nodes, and to ``head``: the launcher's control traffic). One rank per node (local rank
    0) contributes. ``iface=None``: nothing is measured (``total()`` is ``None``).
    """

    def __init__(self, hvd: Any, iface: str | None) -> None:
        self.hvd, self.iface = hvd, iface
        self.reader = iface is not None and hvd.local_rank() == 0
        self.counted = 0
        self.since = self._read() if self.reader else 0
        self.running = True

    def _read(self) -> int:
        with open("/proc/net/dev") as f:
            for line in f:
                name, sep, rest = line.partition(":")
                if sep and name.strip() == self.iface:
                    return int(rest.split()[8])      # transmit bytes
        raise SystemExit(f"--wire-iface {self.iface}: no such interface in /proc/net/dev")

    def pause(self) -> None:
        """Stop counting (before an evaluation: its traffic is not training's)."""
        if self.reader and self.running:
            self.counted += self._read() - self.since
        self.running = False

    def resume(self) -> None:
        """Count again from now."""
        if self.reader and not self.running:
            self.since = self._read()
        self.running = True

    def total(self, name: str) -> float | None:
        """The bytes counted so far, all nodes (collective: every rank calls it, paused)."""
        if self.iface is None:
            return None
        import torch  # noqa: PLC0415

        mine = torch.tensor([float(self.counted if self.reader else 0)], dtype=torch.float64)
        return float(self.hvd.allreduce(mine, op=self.hvd.Sum, name=name))


def write_results(a: argparse.Namespace, module: str, argv: list[str] | None,
                  env: dict[str, str], summary: Any, records: list[dict]) -> str:
    """Write ``<a.out>/<a.name>.json`` (the command, the machine, the environment, the
    summary and the records) and say so.

    Returns:
        The file's path.
    """
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, f"{a.name}.json")
    with open(path, "w") as f:
        json.dump({"command": command_line(None, module, argv),
                   "machine": machine_description(), "environment": env,
                   "summary": summary, "records": records}, f, indent=1)
    print(f"wrote {os.path.relpath(path, ROOT)}")
    return path

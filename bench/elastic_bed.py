"""Fault recovery under Open MPI with ULFM across the namespace test bed (issue 24, item 7).

Brings up a private bed (``cluster/cluster up``) per layout, runs each workload under
``cluster/cluster ompirun --with-ft ulfm`` with each fault, several times, interleaved,
and writes every run's record to a JSON file; ``--markdown`` prints the summary tables of
docs/results/elastic_bed.md from such a file. Every run, and the bed, is under a timeout;
the bed is always taken down, with nothing left running::

    python bench/elastic_bed.py --runs 3 --json docs/results/elastic_bed.json
    python bench/elastic_bed.py --markdown docs/results/elastic_bed.json

Layouts (``--layouts``): ``2x2`` (2 nodes x 2 ranks) and ``4x1``, at ``--bandwidth``.
Workloads (``--workloads``):

- ``train``: ``examples/train.py --elastic`` (hvd.elastic, the digits CNN). Rank 0's
  record gives when it caught the failure, each phase of the reset and when the first
  step after it completed; the figure is the failure to that step.
- ``ddp``: the same with ``--ddp``: a DDP module over the "mpicoll" process group, no
  ``hvd.init()``; the reset rebuilds the groups in place (issue 34).
- ``ps``: the parameter server with ``replicas=1`` (this file's ``ps-worker``: the model,
  data and minibatches of ``examples/ps_train.py``, 2 servers, 2 workers, ``bsp``, Adam;
  ranks placed node by node, so that server 0 and its backup are on different nodes).
  The figure is the failure to the next step completed by a surviving worker.

Faults (``--faults``):

- ``none``: no failure (the reference: final accuracy, step time).
- ``rank``: one rank SIGKILLed (train: rank 2, by itself before step ``--kill-step``;
  ps: server rank 1, from outside, once worker 0 has done a third of its steps).
- ``node``: every rank of the last node SIGKILLed at once (from inside the node; its
  Open MPI daemon, prted, stays).
- ``node-all``: every process of the last node, its ranks and its daemon, SIGKILLed
  (``kill -9 -1`` inside the node): the node is gone.
- ``link``: the last node's link cut (its switch port set down) and left down: Open MPI's
  default failure detection (daemon connections) cannot see it.
- ``link-hb``: the same with ULFM's heartbeat detector on (``--mca mpi_ft_detector true``,
  period/timeout ``--hb-period``/``--hb-timeout``).

``--load-job`` runs a second training job on the machine meanwhile (``examples/train.py``
at 2 ranks under the MPICH venv, outside the bed, restarted while the runs go on, bounded
by ``--timeout`` per run): the "busy machine" case.

A run that does not end within ``--timeout`` s (``--link-timeout`` for a cut link) is
stopped and recorded as ``timed_out`` with whatever its survivors reported.
Environment: ``MPICOLL_CLUSTER_PREFIX``/``SUBNET``/``DIR`` choose the bed (defaults
``mceb``, ``10.83.0``, ``/tmp/mceb-cluster``); ``ULFM_TEST_PYTHON`` the Open MPI python
(default ``.venv-ompi/bin/python``).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "cluster" / "cluster"
LAYOUTS = {"2x2": (2, 2), "4x1": (4, 1)}
FAULTS = ("none", "rank", "node", "node-all", "link", "link-hb")
#: Run inside a node: SIGKILL every child of the node's Open MPI daemon (its ranks).
KILL_RANKS = """
import os, time
def stat(p):
    try:
        with open(f"/proc/{p}/status") as f:
            return {k: v.strip() for k, v in (x.split(":", 1) for x in f if ":" in x)}
    except OSError:
        return {}
procs = [p for p in os.listdir("/proc") if p.isdigit()]
daemons = {p for p in procs if stat(p).get("Name") == "prted"}
ranks = [int(p) for p in procs if stat(p).get("PPid") in daemons and p not in daemons]
t = time.time()
for p in ranks:
    os.kill(p, 9)
print(len(ranks), t)
"""


# ------------------------------------------------------------------ the bed
class Bed:
    """One private namespace bed: up, run in it, down."""

    def __init__(self, nodes: int, slots: int, bandwidth: str) -> None:
        self.nodes, self.slots, self.bandwidth = nodes, slots, bandwidth
        self.env = dict(os.environ)
        self.env.setdefault("MPICOLL_CLUSTER_PREFIX", "mceb")
        self.env.setdefault("MPICOLL_CLUSTER_SUBNET", "10.83.0")
        self.env.setdefault("MPICOLL_CLUSTER_DIR", "/tmp/mceb-cluster")
        for name in [k for k in self.env if k.startswith(("OMPI_", "PMIX_", "PRTE_"))]:
            del self.env[name]
        for name in ("MPICOLL_RANKS_PER_NODE", "MPICOLL_ALGORITHM", "MPICOLL_TUNING_FILE"):
            self.env.pop(name, None)
        self.env.update(PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
        self.prefix = self.env["MPICOLL_CLUSTER_PREFIX"]

    def cluster(self, *args: str, timeout: float = 60) -> str:
        r = subprocess.run([str(CLUSTER), *args], cwd=ROOT, env=self.env, timeout=timeout,
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"cluster {' '.join(args)}: exit {r.returncode}\n"
                               f"{r.stdout}{r.stderr}")
        return r.stdout

    def up(self) -> None:
        self.cluster("up", "--nodes", str(self.nodes), "--slots", str(self.slots),
                     "--bandwidth", self.bandwidth, timeout=120)

    def down(self) -> None:
        subprocess.run([str(CLUSTER), "down"], cwd=ROOT, env=self.env, timeout=120,
                       capture_output=True)

    def kill_in_node(self, node: str, pid: int = -1) -> float:
        """SIGKILL ``pid`` of ``node`` (its PID there), or with -1 every process of the node
        but its holder; returns the time of the kill, taken inside the node."""
        out = self.cluster("exec", node, sys.executable, "-c",
                           "import os, time; n = len([p for p in os.listdir('/proc') if "
                           "p.isdigit() and int(p) not in (1, os.getpid())]); "
                           f"t = time.time(); os.kill({pid}, 9); print(n, t)", timeout=30)
        self.last_kill_count = int(out.split()[-2])
        return float(out.split()[-1])

    def link(self, node: str, state: str) -> float:
        t = time.time()
        subprocess.run(["ip", "-n", f"{self.prefix}-sw", "link", "set", f"p{node}", state],
                       check=True, timeout=10)
        return t

    def clean(self) -> dict[str, int]:
        """Nothing of a run left in any node (its daemons, a cut-off node's ranks); how
        many processes each node still had (the holder's sleep counts 1)."""
        left = {}
        for i in range(1, self.nodes + 1):
            try:
                self.kill_in_node(f"n{i}")
                left[f"n{i}"] = self.last_kill_count
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                left[f"n{i}"] = -1
                print(f"clean n{i}: {exc}", file=sys.stderr, flush=True)
        return left


class Job:
    """``cluster/cluster ompirun ARGS`` in its own session; its output lines, timestamped,
    collected by a thread; ``stop()`` ends the whole session."""

    def __init__(self, bed: Bed, args: list[str]) -> None:
        self.lines: list[tuple[float, str]] = []
        self.ended_at: float | None = None
        self.proc = subprocess.Popen([str(CLUSTER), "ompirun", *args], cwd=ROOT, env=bed.env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.time(), line.rstrip("\n")))

    def wait_for(self, pattern: str, timeout: float) -> re.Match | None:
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        seen = 0
        while time.monotonic() < deadline:
            while seen < len(self.lines):
                m = regex.search(self.lines[seen][1])
                seen += 1
                if m:
                    return m
            if self.proc.poll() is not None and seen >= len(self.lines):
                self.reader.join(1)
                if seen >= len(self.lines):
                    return None
            time.sleep(0.01)
        return None

    def wait(self, timeout: float) -> bool:
        """True if the job ended by itself within ``timeout`` s."""
        try:
            self.proc.wait(timeout=max(0.0, timeout))
            self.ended_at = time.time()
            self.reader.join(5)
            return True
        except subprocess.TimeoutExpired:
            return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(30)
        self.reader.join(5)

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)


# ------------------------------------------------------------------ one run
def ompi_python() -> str:
    return os.environ.get("ULFM_TEST_PYTHON", str(ROOT / ".venv-ompi" / "bin" / "python"))


def mca_for(fault: str, args: argparse.Namespace) -> list[str]:
    mca = ["--with-ft", "ulfm"]
    if fault == "link-hb":
        mca += ["--mca", "mpi_ft_detector", "true",
                "--mca", "mpi_ft_detector_period", str(args.hb_period),
                "--mca", "mpi_ft_detector_timeout", str(args.hb_timeout)]
    return mca


def inject(bed: Bed, fault: str, victim_node: str) -> dict:
    """Fail ``victim_node`` (node fault) or cut its link; the time of it."""
    if fault == "node":
        out = bed.cluster("exec", victim_node, sys.executable, "-c", KILL_RANKS, timeout=30)
        killed, t = out.split()[-2:]
        return {"failed_at": float(t), "victim": f"{killed} rank(s) of {victim_node}"}
    if fault == "node-all":
        return {"failed_at": bed.kill_in_node(victim_node), "victim": f"all of {victim_node}"}
    return {"failed_at": bed.link(victim_node, "down"), "victim": victim_node, "link": "down"}


def run_train(bed: Bed, layout: str, fault: str, args: argparse.Namespace, out: Path,
              ddp: bool = False) -> dict:
    nodes, slots = LAYOUTS[layout]
    rec_file = out / "train.json"
    cmd = [*mca_for(fault, args), "-n", str(nodes * slots), ompi_python(), "-u",
           "examples/train.py", "--elastic", "--epochs", str(args.epochs), "--min-accuracy",
           "0", "--json", str(rec_file)] + (["--ddp"] if ddp else [])
    if fault == "rank":
        cmd += ["--kill-rank", "2", "--kill-step", str(args.kill_step)]
    run, job, began = start(bed, "ddp" if ddp else "train", layout, fault, cmd)
    victim_node = f"n{nodes}"   # the last node: never rank 0's

    def trigger() -> None:
        if fault not in ("none", "rank") and job.wait_for(r"^epoch +1/", args.timeout):
            time.sleep(args.kill_delay)
            run.update(inject(bed, fault, victim_node))

    text = supervise(bed, job, run, victim_node, rec_file, began, args, trigger)
    m = re.search(r"rank 2: SIGKILL at ([0-9.]+)", text)
    if m:
        run["failed_at"] = float(m.group(1))
    if rec_file.exists():
        rec = json.loads(rec_file.read_text())
        if "failed_at" in run:
            run["record_written"] = rec_file.stat().st_mtime - run["failed_at"]
        run.update(final_accuracy=rec["final_accuracy"], ranks_after=rec["ranks"],
                   commits=len(rec["commit_seconds"]),
                   commit_ms=1e3 * statistics.mean(rec["commit_seconds"] or [0]))
        if rec["resets"] and "failed_at" in run:
            run.update(train_phases(rec["resets"][0], run["failed_at"]))
    if job.ended_at is not None and "failed_at" in run:
        run["job_end"] = job.ended_at - run["failed_at"]
    run["wall"] = time.monotonic() - began
    run["log_tail"] = text.splitlines()[-25:]
    return run


def start(bed: Bed, workload: str, layout: str, fault: str, cmd: list[str]
          ) -> tuple[dict, Job, float]:
    """Launch one run: its record so far, its job, its start (monotonic)."""
    run = {"workload": workload, "layout": layout, "fault": fault, "load": os.getloadavg()[0],
           "command": "cluster/cluster ompirun " + " ".join(relative(c) for c in cmd)}
    return run, Job(bed, cmd), time.monotonic()


def supervise(bed: Bed, job: Job, run: dict, victim_node: str, done_file: Path, began: float,
              args: argparse.Namespace, trigger: Callable[[], None]) -> str:
    """Inject the run's fault (``trigger``), wait for the job within its time limit, then
    end it and everything it left on the bed (the cut link restored); the job's output."""
    try:
        trigger()
        limit = args.link_timeout if run["fault"].startswith("link") else args.timeout
        left = limit - (time.monotonic() - began)
        if run["fault"].startswith("link"):   # the cut-off node's ranks never end
            left = wait_file(done_file, job, left)
        run["ended"] = job.wait(left)
    finally:
        job.stop()
        if run.get("link") == "down":
            bed.link(victim_node, "up")
        run["left_in_nodes"] = bed.clean()
    run["exit"] = job.proc.returncode
    return job.text()


def wait_file(path: Path, job: Job, timeout: float) -> float:
    """Wait until ``path`` exists (rank 0's record: the survivors are done) or the job
    ends; return the time left to wait for the job to end (0 if the file came)."""
    deadline = time.monotonic() + max(0.0, timeout)
    while time.monotonic() < deadline and job.proc.poll() is None:
        if path.exists():
            time.sleep(1)   # rank 0 finishes writing; the cut-off node never ends
            return 5.0
        time.sleep(0.05)
    return 0.0


def train_phases(reset: dict, failed_at: float) -> dict:
    """Rank 0's view of one reset, in seconds from the failure (phases in seconds)."""
    detect = reset["detected"] - failed_at
    inside = reset["restore"] + reset["reset"] + reset["callbacks"] + reset["sync"]
    total = reset["first_step"] - failed_at
    return {"failed": reset["failed"], "detect": detect, "revoke": reset["revoke"],
            "shrink": reset["shrink"], "abandon": reset["abandon"], "init": reset["init"],
            "groups": reset.get("groups"), "restore": reset["restore"], "sync": reset["sync"],
            "first_step": total - detect - inside, "recovery": total}


def run_ps(bed: Bed, layout: str, fault: str, args: argparse.Namespace, out: Path) -> dict:
    nodes, slots = LAYOUTS[layout]
    cmd = [*mca_for(fault, args), "--map-by", "node", "-n", str(nodes * slots), ompi_python(),
           "-u", "bench/elastic_bed.py", "ps-worker", "--steps", str(args.ps_steps),
           "--out", str(out), "--hidden", str(args.ps_hidden)]
    run, job, began = start(bed, "ps", layout, fault, cmd)
    victim_node = f"n{nodes}"   # the last node: never rank 0's

    def trigger() -> None:
        if fault != "none" and job.wait_for(r"^PROGRESS", args.timeout):
            if fault == "rank":   # server rank 1, the primary of slot 1
                pids = {int(r): (host, int(pid)) for r, host, pid in
                        re.findall(r"^PID (\d+) (\S+) (\d+)", job.text(), re.M)}
                host, pid = pids[1]
                run.update(failed_at=bed.kill_in_node(host, pid), victim=f"rank 1 ({host})")
            else:
                run.update(inject(bed, fault, victim_node))

    text = supervise(bed, job, run, victim_node, out / "worker0.json", began, args, trigger)
    workers = [json.loads(p.read_text()) for p in sorted(out.glob("worker*.json"))]
    run["workers"] = [{k: w[k] for k in ("rank", "host", "steps", "clock", "final",
                                         "checksum")} for w in workers]
    first = next((w for w in workers if w["worker_index"] == 0), None)
    if first is not None:
        run.update(final_loss=first["final"][0], final_accuracy=first["final"][1],
                   median_step=statistics.median(first["step_seconds"]))
        if "failed_at" in run:
            nexts = [min(t for t in w["done"] if t > run["failed_at"])
                     for w in workers if any(t > run["failed_at"] for t in w["done"])]
            if nexts:
                run["failover"] = min(nexts) - run["failed_at"]
                run["failover_max"] = max(nexts) - run["failed_at"]
            # the longest step among the ten that ended after the failure (the one that
            # waited for the failover), on any surviving worker
            stalls = [d for w in workers for t, d in
                      [(t, d) for t, d in zip(w["done"], w["step_seconds"])
                       if t > run["failed_at"]][:10]]
            if stalls:
                run["longest_step_after"] = max(stalls)
    run["failovers"] = [json.loads(x) for x in re.findall(r"^FAILOVERS (.*)$", text, re.M)]
    if job.ended_at is not None and "failed_at" in run:
        run["job_end"] = job.ended_at - run["failed_at"]
    run["wall"] = time.monotonic() - began
    run["log_tail"] = text.splitlines()[-25:]
    return run


def relative(word: str) -> str:
    return word.replace(str(ROOT) + "/", "")


def save(record: dict, path: Path) -> None:
    """The record as JSON, without this machine's paths (the checkout, the temporary
    directories, the installed packages in the runs' tracebacks)."""
    text = relative(json.dumps(record, indent=1))
    text = re.sub(re.escape(tempfile.gettempdir()) + r"/elastic-bed-\w+", "<tmp>", text)
    text = re.sub(r'[^\s"]*/(?:site|dist)-packages/', "<site-packages>/", text)  # tracebacks
    path.write_text(text + "\n")


# ------------------------------------------------------------------ the PS workload
def ps_worker(argv: list[str]) -> int:
    """Run under MPI: 2 servers with replicas=1, the other ranks workers (ps_train.py's
    model and data); each worker writes ``worker<i>.json`` (when each step completed)."""
    ap = argparse.ArgumentParser(prog="elastic_bed.py ps-worker")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    import socket  # noqa: PLC0415

    import numpy as np  # noqa: PLC0415
    from mpi4py import MPI  # noqa: PLC0415

    sys.path.insert(0, str(ROOT / "examples"))
    import ps_train as pt  # noqa: PLC0415

    from mpicoll.ps import ParameterServer  # noqa: PLC0415
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    seed = 0
    ps = ParameterServer(pt.init_params(a.hidden, seed), comm=world, num_servers=2,
                         consistency="bsp", optimizer="adam", lr=0.02, replicas=1)
    print(f"PID {rank} {socket.gethostname()} {os.getpid()}", flush=True)
    try:
        if ps.is_server:
            ps.serve()
            print("FAILOVERS " + json.dumps({"rank": rank,
                                             "failovers": len(ps._server.failovers)}),
                  flush=True)
        else:
            x, y = pt.worker_data(seed, 8000, ps.worker_index, ps.num_workers)
            test = pt.make_data(2000, seed=seed + 2)
            w = ps.pull()
            end = ps.clock + a.steps
            done, step_seconds, clocks = [], [], []
            while ps.clock < end:
                t0 = time.perf_counter()
                idx = pt.minibatch(seed, ps.worker_index, ps.clock, len(y), 64)
                w = ps.push_pull(pt.gradients(w, x[idx], y[idx]), out=w)
                step_seconds.append(time.perf_counter() - t0)
                done.append(time.time())
                clocks.append(ps.clock)
                if ps.worker_index == 0 and len(done) == a.steps // 3:
                    print(f"PROGRESS {ps.clock}", flush=True)
            ps.close()
            loss, acc = pt.loss_and_accuracy(w, *test)
            rec = {"rank": rank, "host": socket.gethostname(), "worker_index": ps.worker_index,
                   "steps": len(done), "clock": ps.clock, "final": [loss, acc], "done": done,
                   "step_seconds": step_seconds, "clocks": clocks,
                   "checksum": float(sum(np.abs(v).sum() for v in w.values()))}
            path = Path(a.out) / f"worker{ps.worker_index}.json"
            path.with_suffix(".tmp").write_text(json.dumps(rec))
            path.with_suffix(".tmp").rename(path)
    except Exception as exc:  # noqa: BLE001 - reported, then every survivor meets
        print(f"ERROR rank {rank}: {type(exc).__name__}: {exc}", flush=True)
    try:   # survivors meet before exiting (none looks failed to another still working)
        world.Shrink().Barrier()
    finally:
        os._exit(0)


# ------------------------------------------------------------------ summary
def job_end(rs: list[dict]) -> str:
    """When the jobs that did not go on after their failure ended by themselves (median,
    range), and how many were stopped at the timeout."""
    ends = [r["job_end"] for r in rs if r.get("job_end") is not None
            and r.get("recovery") is None and r.get("failover") is None]
    hung = sum(1 for r in rs if r.get("ended") is False)
    text = (f"{statistics.median(ends):.2f} ({min(ends):.2f}-{max(ends):.2f})"
            if ends else "-")
    return text + (f"; {hung} stopped at the timeout" if hung else "")


def accuracies(rs: list[dict]) -> str:
    """The distinct final accuracies of some runs, ``a/b``, or ``-``."""
    return "/".join(sorted({f"{r['final_accuracy']:.4f}" for r in rs
                            if r.get("final_accuracy") is not None})) or "-"


def summarize(path: Path) -> str:
    data = json.loads(path.read_text())
    runs = data["runs"]
    lines = []
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["workload"], r["layout"], r["fault"]), []).append(r)

    def med(rs: list[dict], key: str, scale: float = 1.0, fmt: str = "{:.3f}") -> str:
        vals = [r[key] * scale for r in rs if r.get(key) is not None]
        return fmt.format(statistics.median(vals)) if vals else "-"

    def rng(rs: list[dict], key: str) -> str:
        vals = [r[key] for r in rs if r.get(key) is not None]
        return f"{min(vals):.3f}-{max(vals):.3f}" if vals else "-"

    lines.append("### train (`examples/train.py --elastic`; ddp: `--ddp`), rank 0's view, "
                 "medians\n")
    lines.append("| workload | layout | fault | runs | recovered | load | detect (s) | "
                 "shrink (ms) | new engine (ms) | groups (ms) | restore (ms) | sync (ms) | "
                 "first step (s) | **failure to first step (s)** (range) | ranks after | "
                 "final accuracy | job ended (s after the failure) |")
    lines.append("|" + "---|" * 17)
    for (wl, layout, fault), rs in sorted(groups.items()):
        if wl not in ("train", "ddp"):
            continue
        ended = sum(1 for r in rs if r.get("recovery") is not None)
        loads = [r["load"] for r in rs]
        lines.append(
            f"| {wl} | {layout} | {fault} | {len(rs)} | {ended if fault != 'none' else '-'} | "
            f"{min(loads):.1f}-{max(loads):.1f} | "
            f"{med(rs, 'detect')} | {med(rs, 'shrink', 1e3, '{:.1f}')} | "
            f"{med(rs, 'init', 1e3, '{:.0f}')} | {med(rs, 'groups', 1e3, '{:.0f}')} | "
            f"{med(rs, 'restore', 1e3, '{:.1f}')} | "
            f"{med(rs, 'sync', 1e3, '{:.0f}')} | {med(rs, 'first_step')} | "
            f"**{med(rs, 'recovery')}** ({rng(rs, 'recovery')}) | "
            f"{'/'.join(sorted({str(r.get('ranks_after', '-')) for r in rs}))} | "
            f"{accuracies(rs)} | {job_end(rs)} |")
    lines.append("\n### ps (`ParameterServer(..., replicas=1)`, 2 servers + 2 workers), medians\n")
    lines.append("| layout | fault | runs | went on | load | **failure to next step (s)** "
                 "(range) | longest step after it (s) | median step (s) | steps (worker 0) | "
                 "final loss | final accuracy | job ended (s after the failure) |")
    lines.append("|" + "---|" * 12)
    for (wl, layout, fault), rs in sorted(groups.items()):
        if wl != "ps":
            continue
        ended = sum(1 for r in rs if r.get("failover") is not None)
        loads = [r["load"] for r in rs]
        losses = sorted({f"{r['final_loss']:.5f}" for r in rs if r.get("final_loss") is not None})
        steps = sorted({str(w["steps"]) for r in rs for w in r.get("workers", [])
                        if w["rank"] == min(x["rank"] for x in r["workers"])})
        lines.append(
            f"| {layout} | {fault} | {len(rs)} | {ended if fault != 'none' else '-'} | "
            f"{min(loads):.1f}-{max(loads):.1f} | **{med(rs, 'failover')}** ({rng(rs, 'failover')}) | "
            f"{med(rs, 'longest_step_after')} | {med(rs, 'median_step')} | "
            f"{'/'.join(steps) or '-'} | {'/'.join(losses) or '-'} | {accuracies(rs)} | "
            f"{job_end(rs)} |")
    return "\n".join(lines)


class LoadJob:
    """A second training job on the machine (``--load-job``): ``examples/train.py`` at 2
    ranks (the MPICH venv, outside the bed), started again whenever it ends, until
    :meth:`stop` or ``limit_s`` seconds."""

    def __init__(self, limit_s: float) -> None:
        self._stop = threading.Event()
        self._proc: subprocess.Popen | None = None
        self._deadline = time.monotonic() + limit_s
        threading.Thread(target=self._loop, daemon=True).start()
        time.sleep(5)                          # running before the first measured job

    def _loop(self) -> None:
        venv = ROOT / ".venv" / "bin"
        while not self._stop.is_set() and time.monotonic() < self._deadline:
            self._proc = subprocess.Popen(
                ["timeout", "600", str(venv / "mpiexec"), "-n", "2", str(venv / "python"),
                 "examples/train.py", "--epochs", "20", "--min-accuracy", "0"],
                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True)
            self._proc.wait()

    def stop(self) -> None:
        self._stop.set()
        if self._proc is not None and self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGTERM)
            self._proc.wait(30)


# ------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["ps-worker"]:
        return ps_worker(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", default="2x2,4x1")
    ap.add_argument("--workloads", default="train,ps")
    ap.add_argument("--faults", default="none,rank,node,link-hb,link")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--bandwidth", default="1gbit")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--kill-step", type=int, default=20)
    ap.add_argument("--kill-delay", type=float, default=0.3,
                    help="node/link faults: seconds after rank 0 reports epoch 1")
    ap.add_argument("--ps-steps", type=int, default=150)
    ap.add_argument("--ps-hidden", type=int, default=32)
    ap.add_argument("--hb-period", type=float, default=1.0)
    ap.add_argument("--hb-timeout", type=float, default=5.0)
    ap.add_argument("--timeout", type=float, default=180)
    ap.add_argument("--link-timeout", type=float, default=90)
    ap.add_argument("--json", default=None, help="write (or extend) this record")
    ap.add_argument("--load-job", action="store_true",
                    help="run a second training job on the machine meanwhile")
    ap.add_argument("--markdown", metavar="JSON", help="print the summary of a record")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # bed down
    if args.markdown:
        print(summarize(Path(args.markdown)))
        return 0
    faults = args.faults.split(",")
    bad = set(faults) - set(FAULTS) | set(args.layouts.split(",")) - set(LAYOUTS)
    if bad:
        ap.error(f"unknown fault or layout: {sorted(bad)}")
    record = {"date": time.strftime("%Y-%m-%d"), "cores": os.cpu_count(), "runs": []}
    if args.json and Path(args.json).exists():
        record = json.loads(Path(args.json).read_text())
    load = LoadJob(args.timeout * args.runs * 10) if args.load_job else None
    for layout in args.layouts.split(","):
        bed = Bed(*LAYOUTS[layout], args.bandwidth)
        bed.down()
        bed.up()
        try:
            for i in range(args.runs):
                for workload in args.workloads.split(","):
                    for fault in faults:
                        with tempfile.TemporaryDirectory(prefix="elastic-bed-") as tmp:
                            if workload == "ps":
                                r = run_ps(bed, layout, fault, args, Path(tmp))
                            else:
                                r = run_train(bed, layout, fault, args, Path(tmp),
                                              ddp=workload == "ddp")
                            r["load_job"] = load is not None
                        r["run"] = i + 1
                        record["runs"].append(r)
                        print(json.dumps({k: v for k, v in r.items() if k not in
                                          ("log_tail", "command", "workers")}), flush=True)
                        if args.json:
                            save(record, Path(args.json))
        finally:
            bed.down()
    if load is not None:
        load.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

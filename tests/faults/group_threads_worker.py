"""Subgroups made and destroyed under ULFM leave no thread behind (run by
test_torch_faults.py under ``mpirun --with-ft ulfm -n 3``, not by pytest).

Each subgroup's creation runs on a runtime lane of its own under ULFM
(:func:`mpicoll.runtime.progress.create`); its thread must end with the creation. Prints
``THREADS <rank> <threads before> <threads after 10 subgroups> <their names>``.
"""
from __future__ import annotations

import threading

import torch
import torch.distributed as dist

import mpicoll.torch.distributed  # noqa: F401  (registers "mpicoll")

GROUPS = 10


def main() -> None:
    dist.init_process_group("mpicoll")
    before = threading.active_count()
    for _ in range(GROUPS):
        group = dist.new_group([0, 1])
        if dist.get_rank() in (0, 1):
            t = torch.ones(3)
            dist.all_reduce(t, group=group)
            assert t.tolist() == [2.0, 2.0, 2.0], t
        dist.destroy_process_group(group)
    names = ",".join(sorted(t.name for t in threading.enumerate()))
    print(f"THREADS {dist.get_rank()} {before} {threading.active_count()} {names}",
          flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

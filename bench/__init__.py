"""mpicoll's benchmarks: OSU-style point-to-point and collective tests, the tuner, reports.

Run one with ``mpirun -n N python -m bench.<module>`` (or ``python bench/<module>.py``), or
through the dispatcher ``mpirun -n N python -m bench <name> [options]``:

=================  ==============================================================
``osu_latency``    ping-pong latency between ranks 0 and 1
``osu_bw``         windowed bandwidth 0 -> 1 (as OSU's osu_bw)
``osu_bibw``       windowed bidirectional bandwidth
``osu_allreduce``  all-reduce: every mpicoll algorithm + MPI, interleaved
``osu_reduce_scatter``, ``osu_allgather``, ``osu_bcast``, ``osu_reduce``: likewise
``overhead``       per-call Python overhead of small collectives, memory-copy bandwidth
``tune``           measure this machine and write a tuning table for ``algorithm="auto"``
``make_docs``      run the documented sweep and regenerate docs/benchmarks.md (+ PNGs)
``torch``          training throughput: mpicoll.torch vs DDP (gloo) vs hand-rolled loop
``ps``             parameter-server push/pull throughput and loss vs time (docs/results/ps.md)
``compression``    gradient codecs' throughput; compressed vs uncompressed all-reduce
                   (docs/compression.md)
=================  ==============================================================

Importing this package does not initialise MPI (``--thread-level`` must be applied first).
"""

#: name accepted by ``python -m bench NAME`` -> module.
BENCHMARKS = {
    "latency": "osu_latency", "osu_latency": "osu_latency",
    "bw": "osu_bw", "osu_bw": "osu_bw",
    "bibw": "osu_bibw", "osu_bibw": "osu_bibw",
    "allreduce": "osu_allreduce", "osu_allreduce": "osu_allreduce",
    "reduce_scatter": "osu_reduce_scatter", "osu_reduce_scatter": "osu_reduce_scatter",
    "allgather": "osu_allgather", "osu_allgather": "osu_allgather",
    "broadcast": "osu_bcast", "bcast": "osu_bcast", "osu_bcast": "osu_bcast",
    "reduce": "osu_reduce", "osu_reduce": "osu_reduce",
    "overhead": "overhead", "tune": "tune", "make_docs": "make_docs", "report": "report",
    "torch": "bench_torch", "ps": "bench_ps", "compression": "compression", "soak": "soak",
    "compression_training": "compression_training",
}

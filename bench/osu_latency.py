"""OSU-style point-to-point latency test between ranks 0 and 1 (see :mod:`bench.p2p`).

``mpirun -n 2 python -m bench.osu_latency -m 1:4M -c``
"""
import os
import sys

if not __package__:  # run as a script (python bench/osu_latency.py): find bench and mpicoll
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.p2p import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(test="latency"))

"""OSU-style MPI reduce benchmark: every mpicoll algorithm plus MPI, interleaved.

``mpirun -n 4 python -m bench.osu_reduce -m 8:1M -c -f`` (options: ``--help``;
details in :mod:`bench.collective`).
"""
import os
import sys

if not __package__:  # run as a script (python bench/osu_reduce.py): find bench and mpicoll
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.collective import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(collective="reduce"))

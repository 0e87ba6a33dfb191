"""Training that goes on when a rank or node dies (issue 24).

Under Open MPI with ULFM (``mpirun --with-ft ulfm``) the survivors shrink and continue in
memory; under MPI libraries without ULFM, ``python -m mpicoll.elastic.launch`` relaunches
the job from the last commit written to disk.
"""

"""``import horovod.torch as hvd`` is ``import mpicoll.torch as hvd``.

horovodrun gives each worker ``HOROVOD_RANK`` (its rank at launch) and
``HOROVOD_HOSTNAME``; under ``mpirun`` they are set here from MPI's, as the launcher would.
"""
import os
import socket
import sys

from mpi4py import MPI

import mpicoll.torch

os.environ.setdefault("HOROVOD_RANK", str(MPI.COMM_WORLD.Get_rank()))
os.environ.setdefault("HOROVOD_HOSTNAME", socket.gethostname())
sys.modules[__name__] = mpicoll.torch

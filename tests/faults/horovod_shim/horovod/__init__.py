"""A stand-in ``horovod`` package for running Horovod's own scripts unchanged on mpicoll
(tests/faults/test_horovod_elastic.py puts its parent directory on ``PYTHONPATH``)."""

"""The adapter's engine: the one thread that calls MPI for ``mpicoll.torch``, and what it runs.

- :mod:`.core`: :class:`~.core.Engine`, negotiation rounds on a private communicator;
- :mod:`.negotiation`: cross-rank agreement on which requests run, in one order (no MPI);
- :mod:`.fusion`: buckets of requests that reduce as one message;
- :mod:`.execute`: running the negotiated responses as mpicoll collectives;
- :mod:`.pipeline`: chunked staging of device requests through host memory;
- :mod:`.handles`: Horovod's integer handles over futures;
- :mod:`.notices`: shutdown wake-ups; :mod:`.trace`: the timeline's tensor tracks;
- :mod:`.dtypes`: torch dtypes as numpy views; :mod:`.settings`: the ``MPICOLL_*`` variables.

Nothing here is public API: the public functions are in :mod:`mpicoll.torch`.
"""

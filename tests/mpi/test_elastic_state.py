"""Elastic state on every rank (no failure, no ULFM): Horovod's host update messages
(``State.on_hosts_updated``) are decided by rank 0 for all ranks at a commit (under
``MPICOLL_ELASTIC_HOST_UPDATES=1``: there is no discovery here)."""
from __future__ import annotations

import pytest

import mpicoll.elastic as elastic

from cases import RANK, SIZE

pytestmark = pytest.mark.mpi


@pytest.fixture(autouse=True)
def host_updates(mpicoll_env) -> None:
    mpicoll_env(MPICOLL_ELASTIC_HOST_UPDATES="1")


def test_rank_0s_host_messages_decide_for_every_rank() -> None:
    state = elastic.ObjectState(step=0)
    if RANK == SIZE - 1 and SIZE > 1:        # another rank's message alone: nothing
        state.on_hosts_updated(3.0, elastic.HostUpdateResult.added)
    state.commit()
    if RANK == 0:
        state.on_hosts_updated(2.0, elastic.HostUpdateResult.removed)
    with pytest.raises(elastic.HostsUpdatedInterrupt) as exc:
        state.commit()
    assert exc.value.skip_sync is True       # rank 0's: removed only, on every rank
    state.commit()


def test_run_resets_every_rank_on_rank_0s_host_update() -> None:
    state = elastic.ObjectState(step=0, seen=[])
    resets = []
    state.register_reset_callbacks([lambda: resets.append(state.step)])

    @elastic.run
    def f(state: elastic.ObjectState) -> list:
        state.seen = state.seen + [state.step]
        while state.step < 3:
            state.step += 1
            if RANK == 0 and state.step == 2 and not resets:
                state.on_hosts_updated(1.0, elastic.HostUpdateResult.added)
            state.commit()
        return state.seen

    assert f(state) == [0, 2] and resets == [2]

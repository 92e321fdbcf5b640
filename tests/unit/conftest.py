"""What every unit test shares: none of them reaches this machine's packet filter or its restore locks
(/run/slurmckpt/restore-sync): the job's end and gc lift TCP holds there (netlock.lift_job), and a test of
them must not lift a live cluster's. Tests that want a packet filter pass a fake (fake_filters.py)."""
from __future__ import annotations

from typing import Iterator

import pytest

from slurmckpt.node import packet_filter
from slurmckpt.rank.sharing import rendezvous


@pytest.fixture(autouse=True, scope="session")
def no_node_packet_filter(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    with pytest.MonkeyPatch.context() as m:
        m.setattr(rendezvous, "LOCK_DIR", tmp_path_factory.mktemp("restore-sync"))
        m.setattr(packet_filter, "installed", lambda: [])
        yield

"""What every unit test shares: none of them reaches this machine's packet filter or its restore locks
(/run/slurmckpt/restore-sync): the job's end and gc lift TCP holds there (netlock.lift_job), and a test of
them must not lift a live cluster's. Tests that want a packet filter pass a fake (fake_filters.py).

The tests are grouped by package like src/slurmckpt (tests/unit/<package>/, the project's own checks in
project/, the top-level modules' here); the shared fakes and harnesses stay here, and a test may use another
test module's fakes (`from test_coordinator import Job`): this directory and each package's are on sys.path."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator

import pytest

from slurmckpt.node import packet_filter
from slurmckpt.rank.sharing import rendezvous

UNIT = Path(__file__).resolve().parent
for _dir in [UNIT, *sorted(p for p in UNIT.iterdir() if p.is_dir() and p.name.isidentifier() and p.name != "fixtures")]:
    if str(_dir) not in sys.path:
        sys.path.insert(0, str(_dir))


@pytest.fixture(autouse=True, scope="session")
def no_node_packet_filter(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    with pytest.MonkeyPatch.context() as m:
        m.setattr(rendezvous, "LOCK_DIR", tmp_path_factory.mktemp("restore-sync"))
        m.setattr(packet_filter, "installed", lambda: [])
        yield

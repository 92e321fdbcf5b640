"""One coordinator per job: epochs, PREPARE/READY/CAPTURE/COMMIT/RESUME|FINISH/ABORT across every rank."""
from __future__ import annotations

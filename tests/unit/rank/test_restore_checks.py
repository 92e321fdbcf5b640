"""Which files a restore checks against the capture before criu runs (rank/restore.py files_to_check)."""
from __future__ import annotations

from slurmckpt.rank.restore import files_to_check
from slurmckpt.store.record import Capture, WrittenFile


def test_dev_shm_files_written_back_are_not_checked_as_shared_or_written_files() -> None:
    """A segment two ranks of a node map (ipc_pair --mech shm) is in both ranks' saved /dev/shm files, in
    their shared files and in their written files: the rank restored first writes its saved bytes back (the
    file is 0 B for a moment), and the other rank must not take that for a change made outside the job."""
    segment = "/dev/shm/slurmckpt-ipc-98.0.0"
    manifest = {
        "shm_files": [{"name": segment, "size": 4144}],
        "shared_files": [{"path": segment, "size": 4144, "xxh3": "x"},
                         {"path": "/scratch/u/table.bin", "size": 10, "xxh3": "y"}],
        "truncate": [{"path": segment, "size": 4144, "ino": 7}, {"path": "/home/u/out.log", "size": 3, "ino": 8}],
    }
    shared, truncate = files_to_check(Capture.from_json(manifest).files)
    assert [e["path"] for e in shared] == ["/scratch/u/table.bin"]
    assert [e.path for e in truncate] == ["/home/u/out.log"]


def test_without_saved_dev_shm_files_every_file_is_checked() -> None:
    manifest = {"truncate": [{"path": "/dev/shm/kept", "size": 1, "ino": 1}],
                "shared_files": [{"path": "/dev/shm/kept", "size": 1, "xxh3": "z"}]}
    assert files_to_check(Capture.from_json(manifest).files) == (manifest["shared_files"],
                                                                [WrittenFile("/dev/shm/kept", 1, 1)])

"""Deleted-but-open files ("ghost files"): how big CRIU's --ghost-limit must be for a tree, and when to refuse.

CRIU copies the contents of every unlinked file a process still holds open or mapped into the images and
refuses, per file, any bigger than its --ghost-limit (default 1 MiB: "Can't dump ghost file ... increase
limit"). MPI libraries leave such files behind routinely (OpenMPI's PMIx shared-memory segments are 4 MiB),
so the limit is sized from what the tree holds (proctree.deleted_files), bounded by the admin's cap
`ghost_limit_max` on the bytes one rank's images may hold this way (docs/mpi.md).
"""
from __future__ import annotations

from slurmckpt.errors import CaptureError
from slurmckpt.node.proctree import DeletedFile
from slurmckpt.sizes import size_text

CRIU_DEFAULT = 1 << 20          # criu's own --ghost-limit



def limit_for(files: list[DeletedFile], cap: int, **context: object) -> int:
    """The --ghost-limit that lets criu dump `files` (the biggest one's size, at least criu's default).
    Raises CaptureError naming the biggest files when together they exceed `cap` bytes."""
    total = sum(f.size for f in files)
    if total > cap:
        named = ", ".join(f"{f.path} ({size_text(f.size)}, {f.how} by pid {f.pid})" for f in files[:3])
        more = f" and {len(files) - 3} more" if len(files) > 3 else ""
        raise CaptureError(f"deleted file(s) still in use hold {size_text(total)}, above ghost_limit_max "
                           f"({size_text(cap)}): {named}{more}; CRIU would copy their contents into the images. "
                           "Raise ghost_limit_max in /etc/slurmckpt/slurmckpt.yaml or keep such files "
                           "linked until the program ends", **context)
    return max([CRIU_DEFAULT, *(f.size for f in files)])

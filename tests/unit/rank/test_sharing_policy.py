"""One policy for /dev/shm at a restore (rank/sharing/): a segment ranks of the job share is saved with each
rank's images and written back before criu runs, so a crash after a periodic capture, a reboot or another
node changes nothing there. It used to be fingerprinted as well, and the fingerprint was compared first:
the restore was refused as "changed" although the write-back that came next would have repaired it. Files
outside /dev/shm that ranks map shared are still compared and refused when changed."""
from __future__ import annotations

import os
import shutil
import socket
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from slurmckpt.errors import RestoreError
from slurmckpt.node.launch import Credentials
from slurmckpt.rank import restore
from slurmckpt.rank.context import RestoreState
from slurmckpt.rank.sharing import ipc, rendezvous
from slurmckpt.store.jobstore import file_checksum
from slurmckpt.store.record import RankRecord

CUT, LATER = b"slot 41 at the cut".ljust(64, b"."), b"slot 97 after the cut".ljust(64, b".")


@pytest.mark.system
def test_a_shared_dev_shm_segment_changed_after_the_cut_is_written_back_not_refused(monkeypatch) -> None:
    if os.getuid() != 0:
        pytest.fail("this test drops to another user's credentials: run it as root (as CI does)")
    nobody = Credentials(65534, 65534, (), ())
    top = Path(tempfile.mkdtemp(prefix="shm-policy-"))
    try:
        shm, images, locks = top / "shm", top / "images", top / "locks"
        for d in (shm, images, locks):
            d.mkdir()
        top.chmod(0o755)
        shm.chmod(0o1777)
        monkeypatch.setattr(rendezvous, "LOCK_DIR", locks)
        seg, disk = shm / "ring", top / "mapped-on-disk"
        for f in (seg, disk):
            f.write_bytes(CUT)
            os.chown(f, nobody.uid, nobody.gid)
        (images / "shm-0.data").write_bytes(CUT)             # what the capture saved of the segment
        fingerprints = [{"path": str(f), "size": len(CUT), "xxh3": file_checksum(f), "dev": f.stat().st_dev,
                         "ino": f.stat().st_ino} for f in (seg, disk)]
        manifest = {"kind": "image", "node": socket.gethostname(), "shared_files": fingerprints[:1], "truncate": [],
                    "shm_files": [{"name": str(seg), "size": len(CUT), "mode": 0o600, "data": "shm-0.data",
                                   "links": []}]}
        seg.write_bytes(LATER)                                # the ranks wrote on, then the node crashed
        ctx = SimpleNamespace(store=SimpleNamespace(job=7), cgroup=SimpleNamespace(tree=SimpleNamespace(restart=1)),
                              creds=nobody, step="0", rank=0)

        # what the restore did before: the comparison alone refuses what the write-back repairs
        with pytest.raises(RestoreError, match="changed since the checkpoint"):
            ipc.check_shared_files(fingerprints[:1], rendezvous.restore_key(7, 0, 3), nobody, True, locks)

        st = RestoreState(3, manifest=RankRecord.from_json({**manifest, "files": {}}), images=images)
        restore._shared_files(ctx, st)                        # not compared: it is written back next
        restore._shm(ctx, st)
        assert seg.read_bytes() == CUT

        disk.write_bytes(LATER)                               # a shared file the write-back does not cover
        st = RestoreState(4, manifest=RankRecord.from_json({**manifest, "shared_files": fingerprints, "files": {}}),
                          images=images)
        with pytest.raises(RestoreError, match=f"{disk} .*changed since the checkpoint"):
            restore._shared_files(ctx, st)
    finally:
        shutil.rmtree(top)

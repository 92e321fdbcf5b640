"""Set-up and the package write no fixed names in /tmp: another user could pre-create them as symlinks."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
FIXED_TMP = re.compile(r"(?<![\w./-])/tmp/[\w.${-]")     # /tmp/<name>; /var/tmp/... and bare /tmp are not


def test_no_fixed_names_under_tmp_in_scripts_or_src():
    hits = []
    for path in [*REPO.glob("scripts/*.sh"), *REPO.glob("src/**/*.py"), REPO / "Makefile"]:
        if not path.is_file():
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if FIXED_TMP.search(line) and not line.lstrip().startswith("#"):
                hits.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert not hits, "fixed /tmp names:\n" + "\n".join(hits)


def test_the_pattern_catches_what_setup_used_to_write():
    assert FIXED_TMP.search('CRIU_READY_FILE=/tmp/criu.ready')
    assert FIXED_TMP.search('check >/tmp/slurmckpt-criu-check.log 2>&1')
    assert not FIXED_TMP.search('WORK=/var/tmp/slurmckpt-work/ckptuser1')
    assert not FIXED_TMP.search('cwd="/tmp"')

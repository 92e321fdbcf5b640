"""The README's admin section shows what the project really does: its commands are targets and scripts that
exist (and tests/integration/test_package.py runs the package's commands as written), its plugstack lines are
the ones the package and set-up install, and its slurm.conf lines are the test cluster's."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

from tests.support.readme import admin_blocks, commands

REPO = Path(__file__).resolve().parents[3]


def test_the_sections_commands_are_the_projects():
    assert commands() == ["make deb", "apt-get install --reinstall ./build/slurmckpt_*.deb", "make install",
                          "cp /usr/share/slurmckpt/cli_filter.lua /etc/slurm/cli_filter.lua", "slurmckpt doctor"]
    makefile = (REPO / "Makefile").read_text()
    for target in ("deb", "install"):
        assert re.search(rf"(?m)^{target}:", makefile), target
    assert "bash scripts/build-deb.sh build" in makefile          # what writes ./build/slurmckpt_*.deb
    build = (REPO / "scripts" / "build-deb.sh").read_text()
    assert '"$share/cli_filter.lua"' in build and 'share=$STAGE/usr/share/slurmckpt' in build
    # set-up puts the same file at the same name next to the test cluster's slurm.conf
    assert 'install -m 0644 "$REPO/etc/cli_filter.lua" "$SLURM_ETC/cli_filter.lua"' in (REPO / "scripts/setup.sh").read_text()
    from slurmckpt.cli import COMMANDS
    assert "doctor" in COMMANDS


def test_the_plugstack_lines_are_the_packages_and_set_ups():
    lines = [block[1] for block in admin_blocks() if block[0] == "" and block[1][0].startswith("required ")]
    assert len(lines) == 2
    package = subprocess.run(["bash", "-c", "grep -o 'required /usr/lib/slurmckpt[^\"]*' scripts/build-deb.sh"],
                             cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    assert lines[0] == [package]
    setup = (REPO / "etc" / "plugstack.conf.in").read_text().splitlines()[-1].replace("@SPANK_PREFIX@", "")
    assert lines[1] == [setup]


def test_the_slurm_conf_lines_are_the_test_clusters():
    block = next(lines for lang, lines in admin_blocks() if lines[0].startswith("ProctrackType="))
    template = (REPO / "etc" / "slurm.conf.in").read_text().replace("@SLURM_PLUGIN_DIR@",
                                                                      "/usr/lib/x86_64-linux-gnu/slurm-wlm")
    for line in block:
        assert re.search(rf"(?m)^{re.escape(line)}$", template), line

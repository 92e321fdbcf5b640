"""The Debian package (`make deb`, scripts/build-deb.sh), built from this tree and installed on the test host
with the README's commands. Its paths (/usr/bin, /usr/lib/python3/dist-packages, /usr/lib/slurmckpt, /usr/libexec/slurmckpt) are
disjoint from the test cluster's install (/opt/slurmckpt/venv, /usr/local), and its postinst changes nothing that
exists, so the running cluster keeps what setup installed. Its SPANK plugin is loaded by the real sbatch through a
copy of slurm.conf whose plugstack names the package's line; no job is submitted."""
from __future__ import annotations

import filecmp
import re
import subprocess
import time
from pathlib import Path

import pytest

from tests.integration.slurmjob import run
from tests.support.readme import commands

REPO = Path(__file__).resolve().parents[2]
SITE = Path("/usr/lib/python3/dist-packages/slurmckpt")


@pytest.fixture(scope="module")
def deb() -> Path:
    """Built and installed by the README's own commands (its admin section's first block)."""
    build, install = commands()[:2]
    assert build == "make deb" and install.startswith("apt-get install"), (build, install)
    before = Path("/etc/slurmckpt/slurmckpt.yaml").read_bytes()
    t0 = time.monotonic()
    run("bash", "-c", build, cwd=REPO, timeout=300)
    built = time.monotonic()
    run("bash", "-c", install, cwd=REPO, timeout=300)
    print(f"\n.deb built in {built - t0:.1f}s, installed in {time.monotonic() - built:.1f}s")
    assert Path("/etc/slurmckpt/slurmckpt.yaml").read_bytes() == before, "postinst changed the existing config"
    return next((REPO / "build").glob(f"slurmckpt_{version()}_*.deb"))


def version() -> str:
    return re.search(r'__version__ = "([^"]+)"', (REPO / "src/slurmckpt/__init__.py").read_text()).group(1)


def test_installed_files_are_the_packages_and_the_trees(deb: Path) -> None:
    status = run("dpkg-query", "-W", "-f", "${Status} ${Version}", "slurmckpt").stdout
    assert status == f"install ok installed {version()}", status
    assert run("dpkg", "--verify", "slurmckpt").stdout == ""          # every file as packaged (md5sums)
    listed = [Path(p) for p in run("dpkg", "-L", "slurmckpt").stdout.split()]
    assert all(p.exists() for p in listed)
    for path in (REPO / "src" / "slurmckpt").rglob("*.py"):
        mine = SITE / path.relative_to(REPO / "src" / "slurmckpt")
        assert mine in listed and filecmp.cmp(path, mine, shallow=False), mine
    # slurmckpt gc hourly: the timer where systemd runs, else the cron entry (a conffile)
    assert {Path("/usr/lib/systemd/system/slurmckpt-gc.timer"), Path("/etc/cron.d/slurmckpt")} <= set(listed)
    assert "/etc/cron.d/slurmckpt" in run("dpkg-query", "-W", "-f", "${Conffiles}", "slurmckpt").stdout
    for dependency in ("python3-click", "python3-yaml", "python3-xxhash", "python3-psutil", "slurm-client"):
        assert dependency in run("dpkg-deb", "-f", str(deb), "Depends").stdout


def test_the_commands_run_with_debians_python_and_the_man_pages_are_there(deb: Path) -> None:
    assert run("/usr/bin/slurmckpt", "--version").stdout == f"slurmckpt {version()}\n"
    assert run("/usr/bin/python3", "-c", "import slurmckpt; print(slurmckpt.__file__)",
               cwd=Path("/")).stdout.strip() == str(SITE / "__init__.py")
    out = run("/usr/bin/slurmckpt", "policy", "show", "-P").stdout
    assert out.startswith("SCOPE|ALLOWED|DEFAULT_INTERVAL|MIN_INTERVAL|MAX_INTERVAL|SETTINGS\n")
    p = run("/usr/bin/slurmckpt", "status", "999999999", check=False)
    assert p.returncode == 1 and p.stderr == "slurmckpt: error: Invalid job id specified: 999999999\n"
    assert run("man", "-w", "slurmckpt").stdout.strip() == "/usr/share/man/man1/slurmckpt.1.gz"
    page = run("man", "-P", "cat", "slurmckpt.yaml", timeout=60).stdout
    assert "storage_root" in page and "min_interval" in page


def test_the_packages_plugin_loads_in_sbatch_with_the_packages_paths(deb: Path, tmp_path: Path) -> None:
    line = Path("/usr/share/slurmckpt/plugstack.conf").read_text().splitlines()[-1]
    words = line.split()
    assert words[:2] == ["required", "/usr/lib/slurmckpt/slurmckpt_spank.so"]
    for word in words[1:]:
        path = word.split("=", 1)[-1]
        assert Path(path).exists(), word
    conf = Path("/etc/slurm/slurm.conf").read_text()
    (tmp_path / "plugstack.conf").write_text(line + "\n")
    # Slurm reads cli_filter.lua (CliFilterPlugins=cli_filter/lua) from slurm.conf's own directory
    (tmp_path / "cli_filter.lua").write_text(Path("/etc/slurm/cli_filter.lua").read_text())
    (tmp_path / "slurm.conf").write_text(re.sub(r"(?m)^PlugStackConfig=.*$", f"PlugStackConfig={tmp_path}/plugstack.conf",
                                                conf))
    env = {"SLURM_CONF": str(tmp_path / "slurm.conf"), "PATH": "/usr/bin:/bin"}
    help_text = subprocess.run(["sbatch", "--help"], capture_output=True, text=True, env=env, timeout=60).stdout
    assert "--checkpoint-interval=duration" in help_text and "[slurmckpt]" in help_text
    bad = subprocess.run(["sbatch", "--checkpoint-interval=5x", "--wrap", "true"], capture_output=True, text=True,
                         env=env, timeout=60)
    assert bad.returncode != 0 and "slurmckpt: invalid --checkpoint-interval value '5x'" in bad.stderr, bad.stderr
    exported = run("nm", "-D", "--defined-only", "/usr/lib/slurmckpt/proctrack_slurmckpt.so").stdout
    assert "proctrack_p_signal" in exported and "plugin_version" in exported

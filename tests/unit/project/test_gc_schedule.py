"""`slurmckpt gc` runs hourly on every node once installed (the job epilog's safety net): `make install` lays out
a systemd timer where systemd runs and an /etc/cron.d entry elsewhere (scripts/gc-schedule.sh through set-up's
gc-schedule step), the Debian package both, its cron entry doing nothing where systemd runs. Both layouts are
built into temporary roots; the units pass `systemd-analyze verify`, the crontab line is one cron reads."""
from __future__ import annotations

import re
import stat
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
VENV_BIN = "/opt/slurmckpt/venv/bin/slurmckpt"


def schedule(kind: str, dest: Path, bin_: str = VENV_BIN, **env: str) -> list[Path]:
    p = subprocess.run(["bash", str(REPO / "scripts" / "gc-schedule.sh"), kind, bin_, str(dest)],
                       capture_output=True, text=True, env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", **env})
    assert p.returncode == 0, p.stderr
    return [Path(line) for line in p.stdout.split()]


def check_units(unitdir: Path, bin_: str, verify: bool = True) -> None:
    """The units run `bin_ gc` hourly; `verify`: systemd accepts them (`bin_` must exist on this host)."""
    service, timer = (unitdir / "slurmckpt-gc.service").read_text(), (unitdir / "slurmckpt-gc.timer").read_text()
    assert re.search(rf"(?m)^ExecStart={re.escape(bin_)} gc$", service) and "Type=oneshot" in service
    assert re.search(r"(?m)^OnCalendar=hourly$", timer) and re.search(r"(?m)^WantedBy=timers.target$", timer)
    if not verify:
        return
    p = subprocess.run(["systemd-analyze", "verify", "--man=no", str(unitdir / "slurmckpt-gc.service"),
                        str(unitdir / "slurmckpt-gc.timer")], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


def check_cron(path: Path, bin_: str) -> None:
    st = path.stat()
    assert stat.S_IMODE(st.st_mode) == 0o644 and "." not in path.name      # what cron reads in /etc/cron.d
    jobs = [line.split(None, 6) for line in path.read_text().splitlines()
            if line.strip() and not line.startswith("#") and "=" not in line.split()[0]]
    assert len(jobs) == 1, jobs
    *when, user, command = jobs[0]
    assert when[1:] == ["*", "*", "*", "*"] and 0 <= int(when[0]) < 60 and user == "root"
    assert command == f"[ -d /run/systemd/system ] || {bin_} gc >/dev/null", command
    # as cron runs it: gc where systemd does not run, nothing where it does (its timer does it)
    marker = path.parent / "ran"
    subprocess.run(["sh", "-c", command.replace(f"{bin_} gc", f"touch {marker}")], check=True)
    assert marker.exists() != Path("/run/systemd/system").is_dir()
    marker.unlink(missing_ok=True)


@pytest.mark.system      # systemd-analyze comes with the node's set-up
def test_make_installs_layouts_a_timer_with_systemd_and_a_cron_entry_without(tmp_path):
    units = tmp_path / "systemd" / "usr/local/lib/systemd/system"
    assert schedule("systemd", tmp_path / "systemd") == [units / "slurmckpt-gc.service", units / "slurmckpt-gc.timer"]
    check_units(units, VENV_BIN)
    assert not (tmp_path / "systemd" / "etc").exists()
    cron = tmp_path / "cron" / "etc/cron.d/slurmckpt"
    assert schedule("cron", tmp_path / "cron") == [cron]
    check_cron(cron, VENV_BIN)
    assert not (tmp_path / "cron" / "usr").exists()
    here = "systemd" if Path("/run/systemd/system").is_dir() else "cron"
    assert [p.name for p in schedule("auto", tmp_path / "auto")] == (
        ["slurmckpt-gc.service", "slurmckpt-gc.timer"] if here == "systemd" else ["slurmckpt"])
    # make install runs set-up's step, which installs this host's kind for the venv's command
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"(?m)^\tSLURMCKPT_KEEP_CONFIG=1 bash scripts/setup.sh python spank files gc-schedule$", makefile)
    setup = (REPO / "scripts" / "setup.sh").read_text()
    assert 'bash "$REPO/scripts/gc-schedule.sh" auto "$SLURMCKPT_VENV/bin/slurmckpt"' in setup
    assert "gc-schedule) step_gc_schedule ;;" in setup


@pytest.mark.parametrize("bad", ["slurmckpt", "/opt/x y/slurmckpt", "/opt/x;reboot"])
def test_a_command_that_is_not_a_plain_absolute_path_is_refused(tmp_path, bad):
    p = subprocess.run(["bash", str(REPO / "scripts" / "gc-schedule.sh"), "cron", bad, str(tmp_path)],
                       capture_output=True, text=True)
    assert p.returncode == 1 and "SLURMCKPT" in p.stderr and not (tmp_path / "etc").exists()


@pytest.mark.system
def test_the_debian_package_carries_both_and_enables_the_timer(tmp_path):
    deb = Path(subprocess.run(["bash", str(REPO / "scripts" / "build-deb.sh"), str(tmp_path)], capture_output=True,
                              text=True, check=True, timeout=300).stdout.strip())
    root = tmp_path / "root"
    subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    check_units(root / "usr/lib/systemd/system", "/usr/bin/slurmckpt", verify=False)     # not installed here
    assert (root / "usr/bin/slurmckpt").exists()
    made = schedule("both", tmp_path / "made", "/usr/bin/slurmckpt", UNITDIR="/usr/lib/systemd/system")
    assert {p.relative_to(tmp_path / "made"): p.read_bytes() for p in made} == {
        p.relative_to(tmp_path / "made"): (root / p.relative_to(tmp_path / "made")).read_bytes() for p in made}
    check_cron(root / "etc/cron.d/slurmckpt", "/usr/bin/slurmckpt")
    control = tmp_path / "control"
    subprocess.run(["dpkg-deb", "-e", str(deb), str(control)], check=True)
    assert (control / "conffiles").read_text().split() == ["/etc/cron.d/slurmckpt"]
    postinst = (control / "postinst").read_text()
    assert "systemctl enable --now slurmckpt-gc.timer" in postinst
    assert "systemctl disable --now slurmckpt-gc.timer" in (control / "prerm").read_text()
    listing = subprocess.run(["dpkg-deb", "-c", str(deb)], capture_output=True, text=True, check=True).stdout
    owners = {line.split()[-1]: line.split()[1] for line in listing.splitlines()}
    assert owners["./etc/cron.d/slurmckpt"] == "root/root"

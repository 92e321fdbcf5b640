"""The SPANK chain as Slurm reads it (slurm/plugstack.py, after src/common/plugstack.c): slurm.conf's
PlugStackConfig (default: next to slurm.conf) and its Include lines, plugstack.conf's include globs relative to
the including file, plugins looked up in PluginDir; the plugin's default_interval= from that chain."""
from __future__ import annotations

from pathlib import Path

from slurmckpt.slurm.plugstack import read_chain, slurm_conf_values


def _site(tmp_path: Path) -> Path:
    etc = tmp_path / "etc"
    (etc / "plugstack.conf.d").mkdir(parents=True)
    (tmp_path / "plugins").mkdir()
    (tmp_path / "plugins" / "slurmckpt_spank.so").write_bytes(b"\x7fELF")
    (etc / "slurm.conf").write_text("ClusterName=c\ninclude more.conf\n# PlugStackConfig=/nowhere\n")
    (etc / "more.conf").write_text(f"plugstackconfig={etc}/stack/main.conf\nPluginDir=/nope:{tmp_path}/plugins\n")
    (etc / "stack").mkdir()
    (etc / "stack" / "main.conf").write_text("optional /usr/lib/pyxis.so   # containers\ninclude ../plugstack.conf.d/*.conf\n")
    (etc / "plugstack.conf.d" / "50-slurmckpt.conf").write_text(
        "required slurmckpt_spank.so wrapper=/w agent=/a default_interval=1h30m\n")
    (etc / "plugstack.conf.d" / "10-other.conf").write_text("requird /x.so\n")
    return etc


def test_the_chain_follows_plugstackconfig_includes_and_plugindir(tmp_path: Path):
    etc = _site(tmp_path)
    chain = read_chain(str(etc / "slurm.conf"))
    assert chain.plugstack == f"{etc}/stack/main.conf"
    assert chain.files == [f"{etc}/stack/main.conf", f"{etc}/stack/../plugstack.conf.d/10-other.conf",
                           f"{etc}/stack/../plugstack.conf.d/50-slurmckpt.conf"]     # glob matches sorted
    line = chain.slurmckpt()
    assert (line.kind, line.line, line.resolved) == ("required", 1, f"{tmp_path}/plugins/slurmckpt_spank.so")
    assert line.arg("agent") == "/a" and line.arg("nope") is None
    assert chain.default_interval() == 5400
    assert chain.problems == [f"{etc}/stack/../plugstack.conf.d/10-other.conf:1: not 'required PATH', 'optional "
                              "PATH' or 'include GLOB': 'requird /x.so'"]
    assert [l.path for l in chain.lines] == ["/usr/lib/pyxis.so", "slurmckpt_spank.so"]
    assert chain.lines[0].resolved is None


def test_default_plugstack_is_next_to_slurm_conf_and_a_missing_one_is_said(tmp_path: Path):
    (tmp_path / "slurm.conf").write_text("ClusterName=c\n")
    chain = read_chain(str(tmp_path / "slurm.conf"))
    assert chain.plugstack == str(tmp_path / "plugstack.conf") and chain.slurmckpt() is None
    assert "does not exist" in chain.problems[0] and chain.default_interval() == 0
    (tmp_path / "plugstack.conf").write_text("include /nonexistent/*.conf\nrequired /p/slurmckpt_spank.so "
                                             "default_interval=2x\n")
    chain = read_chain(str(tmp_path / "slurm.conf"))
    assert chain.problems == [] and chain.slurmckpt().resolved is None
    assert chain.default_interval() == 0          # a value the shim refuses wraps no job


def test_include_loops_end(tmp_path: Path):
    (tmp_path / "slurm.conf").write_text("")
    (tmp_path / "plugstack.conf").write_text("include plugstack.conf\n")
    chain = read_chain(str(tmp_path / "slurm.conf"))
    assert "deeper than" in chain.problems[-1]
    (tmp_path / "slurm.conf").write_text("Include slurm.conf\nPluginDir=/a\n")
    assert slurm_conf_values(str(tmp_path / "slurm.conf"), ("PluginDir",)) == {"PluginDir": "/a"}

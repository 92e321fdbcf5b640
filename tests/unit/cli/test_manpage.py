"""slurmckpt(1) and slurmckpt.yaml(5) come from the code (manpage.py): every command and option the CLI has,
every config key with its default and description, the policy keys; groff renders both without a warning."""
from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

import click
import pytest

from slurmckpt.cli import manpage
from slurmckpt.cli import cli
from slurmckpt.config import Config
from slurmckpt.policy import RULE_DOCS

pytestmark = pytest.mark.system      # groff comes with the node's set-up (scripts/setup.sh packages)


def render(path: Path) -> str:
    p = subprocess.run(["groff", "-man", "-Tutf8", "-ww", "-P-cbou", str(path)], capture_output=True, text=True,
                       check=True)
    assert p.stderr == "", p.stderr
    return p.stdout.replace("\u2010", "-").replace("\u2212", "-")


def test_the_command_page_has_every_command_and_option(tmp_path: Path):
    page = render(manpage.write(tmp_path)[0])
    assert "slurmckpt migrate [OPTIONS] JOB" in page and "EXIT STATUS" in page
    for path, command in manpage._commands(cli, ["slurmckpt"]):
        assert " ".join(path) in page, path
        for param in command.params:
            if isinstance(param, click.Option) and not param.hidden:
                for opt in param.opts:
                    assert opt in page, (path, opt)


def test_the_config_page_has_every_key_with_its_default_and_the_policy_keys(tmp_path: Path):
    page = " ".join(render(manpage.write(tmp_path)[1]).split())
    for f in dataclasses.fields(Config):
        if f.metadata.get("internal"):
            continue
        assert f.metadata.get("doc"), f"config key {f.name} has no description"
        assert f"{f.name} {' '.join(f.metadata['doc'].split())[:40]}" in page, f.name
        assert f"Default: {manpage._default(f)}." in page, f.name
    for key in RULE_DOCS:
        assert key in page
    assert "/etc/slurmckpt/slurmckpt.yaml" in page and "SLURMCKPT_CONFIG" in page

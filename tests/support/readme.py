"""The README's admin section as tests read it: its fenced blocks, in order, with their language."""
from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"
ADMIN = "## Install on a real cluster (admins)"


def admin_blocks() -> list[tuple[str, list[str]]]:
    """(language, lines) of every fenced block of the admin section."""
    text = README.read_text()
    section = text[text.index(ADMIN):]
    section = section[:section.index("\n## ", len(ADMIN))]
    return [(lang, body.strip("\n").splitlines()) for lang, body in re.findall(r"```(\w*)\n(.*?)```", section, re.S)]


def commands() -> list[str]:
    """Every command line of the section's `sh` blocks, in order."""
    return [line for lang, lines in admin_blocks() if lang == "sh" for line in lines]

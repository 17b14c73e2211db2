"""The README is a front page that stays true: short, its links resolve, its commands parse.

Every ``edgepipe …`` line in the README's shell blocks must name a real command and only the
options that command declares, so a renamed flag fails here rather than on a new user's machine.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer

from edgepipe.cli import app

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _shell_lines(text: str) -> list[str]:
    lines, inside, pending = [], False, ""
    for line in text.splitlines():
        if line.startswith("```"):
            inside = line.strip() in ("```bash", "```sh") if not inside else False
            continue
        if inside and line.strip() and not line.lstrip().startswith("#"):
            pending += line.strip()
            if pending.endswith("\\"):
                pending = pending[:-1] + " "
                continue
            lines.append(pending)
            pending = ""
    return lines


def _edgepipe_commands(text: str) -> list[list[str]]:
    out = []
    for line in _shell_lines(text):
        for part in re.split(r"&&|\|\||;", line):
            words = shlex.split(part, comments=True)
            while words and "=" in words[0] and not words[0].startswith("-"):
                words = words[1:]  # VAR=value prefixes
            if words and words[0].endswith("edgepipe"):
                out.append(words[1:])
    return out


def _check(words: list[str]) -> None:
    group = typer.main.get_command(app)
    if words[0].startswith("--"):  # an option of the program itself (--version, --help)
        assert words[0] in {opt for param in group.params for opt in param.opts}, f"README: `edgepipe {words[0]}` is no option"
        return
    name, args = words[0], words[1:]
    command = group.commands.get(name)
    assert command is not None, f"README names `edgepipe {name}`, which is no command"
    known = {opt for param in command.params for opt in getattr(param, "opts", []) + getattr(param, "secondary_opts", [])}
    for arg in args:
        if arg.startswith("--"):
            flag = arg.split("=", 1)[0]
            assert flag in known, f"README: `edgepipe {name} {flag}` is not an option of {name}"


def test_the_readme_is_a_front_page():
    text = README.read_text()
    assert len(text.splitlines()) <= 350
    for heading in ("## The two commands", "## Adding a device", "## The API", "## How it works"):
        assert heading in text


def test_every_link_of_the_readme_and_docs_resolves():
    pages = [README, *sorted((ROOT / "docs").glob("*.md"))]
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)\)", page.read_text()):
            if "://" in target:
                continue
            assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"


def test_the_readme_runs_the_two_commands_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "bash scripts/bootstrap.sh test && .venv/bin/python -m pytest" in ci
    assert "bash scripts/bootstrap.sh test && .venv/bin/python -m pytest" in README.read_text()
    assert "bash scripts/bootstrap.sh && .venv/bin/edgepipe serve" in README.read_text()


@pytest.mark.parametrize("page", ["README.md", "docs/usage.md", "docs/devices.md"])
def test_every_edgepipe_command_in_the_docs_parses(page):
    commands = _edgepipe_commands((ROOT / page).read_text())
    assert commands, f"{page} shows no edgepipe command"
    for words in commands:
        _check(words)


def test_the_command_check_bites():
    with pytest.raises(AssertionError):
        _check(["serve", "--no-such-flag"])
    with pytest.raises(AssertionError):
        _check(["no-such-command"])

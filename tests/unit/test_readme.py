"""The top README as a new user reads it: the quick start's two commands, then a first
read and write right after them (the examples themselves run in
``tests/integration/test_doc_examples.py``), where ``make run`` keeps its data, how to
install the library, and no wall of text (a line as rendered, links shown by their text,
is at most ``MAX_LINE`` characters; the quick start's at most ``MAX_QUICK_LINE``)."""
from __future__ import annotations

import re
from pathlib import Path

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()
MAX_LINE = 300
MAX_QUICK_LINE = 100
LINK = re.compile(r"\[([^\]]*)\]\([^)]*\)")


def section(title: str) -> str:
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## )", README, re.M | re.S)
    assert m, title
    return m.group(1)


def test_no_line_is_a_wall_of_text():
    long = [(n, len(LINK.sub(r"\1", line))) for n, line in enumerate(README.splitlines(), 1)
            if len(LINK.sub(r"\1", line)) > MAX_LINE]
    assert not long, long
    quick = section("Quick start")
    assert max(map(len, quick.splitlines())) <= MAX_QUICK_LINE


def test_the_quick_start_is_two_commands_then_a_first_read_and_write():
    quick = section("Quick start")
    assert re.search(r"^make run\b.*\n^make test\b", quick, re.M)
    writes = re.findall(r"^chp (set|get|dump) ", quick, re.M)
    assert writes[:2] == ["set", "get"]
    assert "from clonemap import Clone" in quick and "clone.set(" in quick
    assert "run/four-demo/" in quick  # where make run's data and keys are


def test_installing_says_which_extra_is_for_what():
    install = section("Installing the library")
    for line in ("pip install clonemap`", "pip install 'clonemap[config]'",
                 "pip install 'clonemap[metrics]'", "pip install 'clonemap[server]'",
                 "supervisor init "):
        assert line in install, line

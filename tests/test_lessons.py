"""Lessons keep their promises: the tests and files they cite exist, and each has the course's sections."""

import json
import re

import pytest

from tests.conftest import REPO, load_script

LESSONS = sorted((REPO / "lessons").glob("[0-9][0-9]_*.md"))
prose_metrics = load_script(REPO / "scripts" / "prose_metrics.py")
# Lessons written to ../shared/STYLE.md's "How a lesson should read" (01-06: issue 24, 07-12: issue 25, 13 from the
# start: issue 26): every lesson.
READABLE = LESSONS
SECTIONS = ("## Pitfalls", "## Errata", "## Summary", "## Exercises", "## How to run", "## What you should see")


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda path: path.stem)
def test_a_lesson_has_every_section_and_a_notebook(lesson):
    text = lesson.read_text()
    assert [section for section in SECTIONS if section not in text] == []
    assert (REPO / "notebooks" / f"{lesson.stem}.ipynb").exists()


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda path: path.stem)
def test_every_cited_test_exists(lesson):
    citations = re.findall(r"(tests/[\w/]+\.py)::(\w+)", lesson.read_text())
    missing = [
        f"{path}::{name}"
        for path, name in citations
        if not (REPO / path).exists() or f"def {name}(" not in (REPO / path).read_text()
    ]
    assert citations and missing == []


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda path: path.stem)
def test_every_cited_file_exists(lesson):
    paths = set(
        re.findall(
            r"\b((?:common|solutions|labs|notebooks|lessons|benchmarks|tests)/[\w/.]+\.(?:py|ipynb|md))",
            lesson.read_text(),
        )
    )
    assert paths and sorted(path for path in paths if not (REPO / path).exists()) == []


@pytest.mark.parametrize("lesson", READABLE, ids=lambda path: path.stem)
def test_a_rewritten_lesson_reads_to_the_style_guides_targets_with_pictures_and_evidence_apart(lesson):
    measured = prose_metrics.metrics(str(lesson))
    assert measured["w/sent med"] <= 17 and measured["w/sent p90"] <= 30, measured
    assert measured["% >40w"] <= 3 and measured["semi/sent"] < 0.05 and measured["paren/sent"] < 0.35, measured
    assert measured["tests/1kw"] == 0, "a test is cited in the prose: move it to its section's Checked by list"
    text = lesson.read_text()
    assert len(set(re.findall(r"!\[[^\]]+\]\(figures/[^)]+\.png\)", text))) >= 4, "fewer than four pictures"
    assert text.count("**Checked by**") >= 4


@pytest.mark.parametrize("lesson", READABLE, ids=lambda path: path.stem)
def test_a_rewritten_lessons_notebook_reads_to_the_same_targets_in_its_markdown_cells(lesson, tmp_path):
    notebook = json.loads((REPO / "notebooks" / f"{lesson.stem}.ipynb").read_text())
    markdown = ["".join(cell["source"]) for cell in notebook["cells"] if cell["cell_type"] == "markdown"]
    (tmp_path / "cells.md").write_text("\n\n".join(markdown))
    measured = prose_metrics.metrics(str(tmp_path / "cells.md"))
    assert measured["w/sent med"] <= 17 and measured["w/sent p90"] <= 30, measured
    assert measured["% >40w"] <= 3 and measured["semi/sent"] < 0.05 and measured["paren/sent"] < 0.35, measured
    assert measured["tests/1kw"] == 0, measured


def test_there_are_lessons():
    assert LESSONS

"""Lessons keep their promises: the tests and files they cite exist, and each has the course's sections."""

import re

import pytest

from tests.conftest import REPO

LESSONS = sorted((REPO / "lessons").glob("[0-9][0-9]_*.md"))
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


def test_there_are_lessons():
    assert LESSONS

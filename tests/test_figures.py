"""The lessons' pictures: each is drawn by scripts/make_figures.py, from code or a committed result, and embedded."""

import re

from tests.conftest import PYTHON, REPO, load_script, run_command

make_figures = load_script(REPO / "scripts" / "make_figures.py")
EMBEDDED = re.compile(r"!\[([^\]]*)\]\(figures/([^)]+)\.png\)")


def embedded_figures() -> dict[str, list[str]]:
    """``{figure name: [alt text, ...]}`` over every lesson."""
    found = {}
    for lesson in sorted((REPO / "lessons").glob("*.md")):
        for alt, name in EMBEDDED.findall(lesson.read_text()):
            found.setdefault(name, []).append(alt)
    return found


def test_every_figure_is_embedded_with_alt_text_and_every_embedded_one_is_drawn_by_the_script():
    embedded = embedded_figures()
    assert set(embedded) == set(make_figures.FIGURES), (sorted(embedded), sorted(make_figures.FIGURES))
    assert all(len(alt.split()) >= 5 for alts in embedded.values() for alt in alts), embedded
    for name in embedded:
        assert (REPO / "lessons" / "figures" / f"{name}.png").is_file(), f"{name}.png is not committed"


def test_the_script_draws_every_figure_from_its_committed_source(tmp_path):
    for name, (_, source) in make_figures.FIGURES.items():
        assert source is None or source.is_file(), f"{name}: its source {source} is not committed"
    run = run_command([PYTHON, REPO / "scripts" / "make_figures.py", "--out", tmp_path], timeout=120)
    assert run.returncode == 0, run.output[-2000:]
    drawn = sorted(path.stem for path in tmp_path.glob("*.png"))
    assert drawn == sorted(make_figures.FIGURES)
    assert all(path.stat().st_size > 10_000 for path in tmp_path.glob("*.png"))  # a picture, not an empty canvas

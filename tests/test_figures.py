"""The lessons' pictures: each is drawn by scripts/make_figures.py, from code or a committed result, and embedded."""

import re

import matplotlib.image
import numpy as np

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
    unused = {path.stem for path in (REPO / "lessons" / "figures").glob("*.png")} - set(embedded)
    assert not unused, f"committed but embedded nowhere: {sorted(unused)}"


def test_the_script_redraws_every_committed_figure_from_its_source_pixel_for_pixel(tmp_path):
    for name, (_, source) in make_figures.FIGURES.items():
        assert source is None or source.is_file(), f"{name}: its source {source} is not committed"
    run = run_command([PYTHON, REPO / "scripts" / "make_figures.py", "--out", tmp_path], timeout=300)
    assert run.returncode == 0, run.output[-2000:]
    drawn = sorted(path.stem for path in tmp_path.glob("*.png"))
    assert drawn == sorted(make_figures.FIGURES)
    differ = []
    for path in sorted(tmp_path.glob("*.png")):
        assert path.stat().st_size > 10_000, f"{path.name}: a picture, not an empty canvas"
        redrawn, committed = (matplotlib.image.imread(p) for p in (path, REPO / "lessons" / "figures" / path.name))
        if redrawn.shape != committed.shape or not np.array_equal(redrawn, committed):
            differ.append(path.name)
    assert differ == [], f"run python scripts/make_figures.py and commit: {differ} differ from their code or source"

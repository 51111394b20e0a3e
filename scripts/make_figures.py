"""Draw the lessons' pictures into lessons/figures/: diagrams from code, measured figures from committed results.

    python scripts/make_figures.py              # every figure
    python scripts/make_figures.py --list       # their names and sources
    python scripts/make_figures.py --only 03_   # the figures whose names start with 03_

Each lesson's figures are functions in ``scripts/lesson_figures/lNN_<topic>.py``, registered in its ``FIGURES`` with
the file it writes and, for a measured one, the committed result it reads (never a run of its own: the figure shows
what the lesson quotes). A lesson embeds a figure with ``![what it shows](figures/NAME.png)``. The files carry no
date, so drawing twice gives the same pictures: tests/test_figures.py redraws every one, compares it with the
committed file pixel by pixel, and checks that each is embedded with alt text.
"""

import argparse
import importlib
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIGURES_DIR = REPO / "lessons" / "figures"
sys.path[:0] = [str(REPO), str(REPO / "scripts")]  # common/ and lesson_figures/, however this file is started


def all_figures() -> dict:
    """``{name: (draw, source)}`` over every module of scripts/lesson_figures/, in lesson order."""
    figures = {}
    for module_path in sorted((REPO / "scripts" / "lesson_figures").glob("l[0-9][0-9]_*.py")):
        module = importlib.import_module(f"lesson_figures.{module_path.stem}")
        clashes = set(figures) & set(module.FIGURES)
        assert not clashes, f"{module_path.name} redefines {sorted(clashes)}"
        figures |= module.FIGURES
    return figures


FIGURES = all_figures()


def main(args) -> None:
    out = args.out or FIGURES_DIR
    out.mkdir(parents=True, exist_ok=True)
    chosen = {name: figure for name, figure in FIGURES.items() if name.startswith(args.only)}
    if not chosen:
        raise SystemExit(f"no figure's name starts with {args.only!r}; see --list")
    for name, (draw, source) in chosen.items():
        if args.list:
            print(f"{name}: {'diagram' if source is None else source.relative_to(REPO)}")
            continue
        draw(out / f"{name}.png")
        print(f"wrote {(out / f'{name}.png')}")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="list the figures and their sources, draw nothing")
    parser.add_argument("--only", default="", help="draw only the figures whose names start with this")
    parser.add_argument("--out", type=Path, help="draw into this folder instead of lessons/figures")
    return parser.parse_args(argv)


if __name__ == "__main__":
    main(parse_args())

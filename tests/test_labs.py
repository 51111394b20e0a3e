"""Every lab is a starter, written from its solution: it has lab tests, and it still fails them (no solution leaked)."""

import pytest

from tests.conftest import PYTHON, REPO, load_script, run_command

LABS = sorted(path.stem for path in (REPO / "labs").glob("*.py"))


def test_there_are_labs():
    assert LABS


@pytest.mark.parametrize("name", LABS)
def test_every_lab_has_a_solution_lab_tests_and_todos(name):
    assert (REPO / "solutions" / f"{name}.py").exists()
    assert (REPO / "tests" / "labs" / f"test_{name}.py").exists()
    assert "raise NotImplementedError" in (REPO / "labs" / f"{name}.py").read_text()


# Slow (a minute and a half for all labs): `make test-slow` runs it. `make test` keeps the quick guards above: every
# lab has its tests and its TODOs, and is what make_labs writes from the marked solution.
@pytest.mark.slow
@pytest.mark.parametrize("name", LABS)
def test_the_starter_still_fails_its_lab_tests(name):
    # -x: the first failure proves the point; running the rest against a starter only costs CI time.
    run = run_command(
        [PYTHON, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", f"tests/labs/test_{name}.py"],
        timeout=600,
        env_extra={"LAB_TARGET": "labs"},
    )
    assert run.returncode == 1, run.output  # 1: tests ran and some failed
    assert "NotImplementedError" in run.output and " failed" in run.stdout


def test_the_labs_are_what_make_labs_writes_from_the_solutions():
    # A solution marks what its lab leaves to the student (# BEGIN LAB / # END LAB); labs/ is generated from them.
    run = run_command([PYTHON, "scripts/make_labs.py", "--check"], timeout=60)
    assert run.returncode == 0, run.output


def test_make_labs_replaces_a_marked_part_with_a_todo_and_a_marked_import_with_a_stub(tmp_path, monkeypatch):
    make_labs = load_script(REPO / "scripts" / "make_labs.py")
    solution = tmp_path / "99_demo.py"
    solution.write_text('''"""Lab 99: a demo.

More text.
"""

from common.cli import positive_int
# BEGIN LAB: write it yourself
from common.cli import parse_size  # isort: skip
# END LAB


def double(x):
    """Twice x."""
    # BEGIN LAB: double x
    # Add x to itself.
    return x + x
    # END LAB
''')
    lab = make_labs.make_lab(solution)
    assert "- ``parse_size``: write it yourself\n- in ``double``: double x\n" in lab
    assert "tests/labs/test_99_demo.py" in lab and "More text." in lab
    assert "return x + x" not in lab and "from common.cli import parse_size" not in lab
    assert '    # TODO: double x\n    # Add x to itself.\n    raise NotImplementedError("TODO: double x")\n' in lab
    assert "def parse_size(text: str) -> int:" in lab and 'raise NotImplementedError("TODO: parse_size")' in lab
    assert "from common.cli import UNITS" in lab  # what the finished parse_size uses


def test_make_labs_copies_a_class_from_a_marked_import_with_the_parts_it_marks_taken_out(tmp_path, monkeypatch):
    make_labs = load_script(REPO / "scripts" / "make_labs.py")
    monkeypatch.setattr(make_labs, "REPO", tmp_path)  # source() reads lab_demo/by_hand.py from here
    (tmp_path / "lab_demo").mkdir()
    (tmp_path / "lab_demo" / "by_hand.py").write_text('''"""A module that a lab copies from."""

import math

SCALE = 2


def halve(x):
    """Half of x."""
    return x / SCALE


class Base:
    """What Doubler builds on."""

    offset = math.pi


class Doubler(Base):
    """Doubles."""

    def forward(self, x):
        """Twice x."""
        # BEGIN LAB: double x
        # Four halves of x.
        return halve(x) * 4
        # END LAB
''')
    solution = tmp_path / "99_demo.py"
    solution.write_text('''"""Lab 99: a demo.

More text.
"""

import sys

# BEGIN LAB: the doubler of lab_demo/by_hand.py
from lab_demo.by_hand import Doubler, Base  # isort: skip
# END LAB
''')
    lab = make_labs.make_lab(solution)
    assert "- in ``Doubler.forward``: double x\n" in lab
    assert "import math\nfrom lab_demo.by_hand import halve\n" in lab  # what the classes use, not the classes
    assert lab.index("class Base:\n") < lab.index("class Doubler(Base):\n")  # MODULE's order, not the import's
    assert "    offset = math.pi\n" in lab and '        """Twice x."""\n' in lab
    assert "return halve(x) * 4" not in lab and "import Doubler" not in lab
    assert (
        '        # TODO: double x\n        # Four halves of x.\n        raise NotImplementedError("TODO: double x")\n'
        in lab
    )
    monkeypatch.syspath_prepend(tmp_path)  # the lab runs: it imports halve from lab_demo.by_hand
    namespace = {}
    exec(compile(lab, "99_demo.py", "exec"), namespace)
    with pytest.raises(NotImplementedError, match="TODO: double x"):
        namespace["Doubler"]().forward(1.0)

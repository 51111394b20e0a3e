"""Every lab is a starter: it has a solution and lab tests, and it still fails them (no solution leaked)."""

import pytest

from tests.conftest import PYTHON, REPO, run_command

LABS = sorted(path.stem for path in (REPO / "labs").glob("*.py"))


def test_there_are_labs():
    assert LABS


@pytest.mark.parametrize("name", LABS)
def test_every_lab_has_a_solution_lab_tests_and_todos(name):
    assert (REPO / "solutions" / f"{name}.py").exists()
    assert (REPO / "tests" / "labs" / f"test_{name}.py").exists()
    assert "raise NotImplementedError" in (REPO / "labs" / f"{name}.py").read_text()


@pytest.mark.parametrize("name", LABS)
def test_the_starter_still_fails_its_lab_tests(name):
    # -x: the first failure proves the point; running the rest against a starter only costs CI time.
    run = run_command([PYTHON, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", f"tests/labs/test_{name}.py"],
                      timeout=600, env_extra={"LAB_TARGET": "labs"})
    assert run.returncode == 1, run.output  # 1: tests ran and some failed
    assert "NotImplementedError" in run.output and " failed" in run.stdout

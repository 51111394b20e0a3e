"""Lab tests: one file per lab, run against ``solutions/`` or, with ``LAB_TARGET=labs``, against ``labs/``.

Each test file names once, in ``NEEDS``, what it uses from the script under test, and loads the script with
``load_lab``: a missing name then fails at once with that list, not with an ``AttributeError`` inside a test.
"""

from tests.conftest import lab_path, load_script


def load_lab(name: str, needs: tuple[str, ...]):
    """Import lab ``name``'s script (``lab_path``: the solution, or your lab) and check that it defines ``needs``."""
    script = load_script(lab_path(name))
    missing = [need for need in needs if not hasattr(script, need)]
    if missing:
        raise AttributeError(f"{lab_path(name)} must define {', '.join(missing)}: tests/labs/test_{name}.py uses them")
    return script

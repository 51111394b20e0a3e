"""The map of ``common/`` in ``common/__init__.py`` names every module, and only modules that exist."""

import re

import common
from tests.conftest import REPO


def test_the_module_map_names_every_module_of_common_and_nothing_else():
    package = REPO / "common"
    modules = {path.stem for path in package.glob("*.py") if path.stem != "__init__"}
    modules |= {path.parent.name for path in package.glob("*/__init__.py")}  # subpackages, should there be any
    mapped = re.findall(r"^- ``common\.(\w+)``", common.__doc__, flags=re.MULTILINE)
    assert len(mapped) == len(set(mapped)), f"named twice: {sorted({m for m in mapped if mapped.count(m) > 1})}"
    assert sorted(modules - set(mapped)) == [], "modules missing from the map in common/__init__.py"
    assert sorted(set(mapped) - modules) == [], "names in the map in common/__init__.py without a module"

"""No layer imports from a layer above it: kernels < backends < client (and the tests,
scripts and model.py files above all). Read from the sources, imports inside functions too."""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
ABOVE = {"kernels": {"backends", "client", "tests", "scripts"}, "backends": {"client", "tests", "scripts"}}


def imported_packages(path: pathlib.Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


@pytest.mark.parametrize("layer", sorted(ABOVE))
def test_no_layer_imports_from_above(layer):
    wrong = {str(path.relative_to(ROOT)): sorted(imported_packages(path) & ABOVE[layer])
             for path in (ROOT / layer).rglob("*.py")}
    assert not {path: names for path, names in wrong.items() if names}

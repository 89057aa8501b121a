"""Rules of the house that a reader relies on (issue #39): the project is imported as an installed package,
never through ``sys.path`` edits, and a module over about 450 lines says at its top why it is long."""
import ast
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LONG = 450


def python_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True)
    return [ROOT / line for line in listed.stdout.splitlines() if (ROOT / line).is_file()]


def edits_sys_path(tree: ast.AST) -> list[int]:
    """Lines that change ``sys.path``: a call of one of its methods, or an assignment to it or to an item."""
    def is_sys_path(node: ast.AST) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "path"
                and isinstance(node.value, ast.Name) and node.value.id == "sys")

    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and is_sys_path(node.func.value):
            lines.append(node.lineno)
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        for target in targets:
            if is_sys_path(target) or (isinstance(target, ast.Subscript) and is_sys_path(target.value)):
                lines.append(node.lineno)
    return sorted(lines)


def test_the_rule_finds_each_way_of_editing_sys_path():
    tree = ast.parse("import sys\nsys.path.insert(0, 'x')\nsys.path.append('y')\nsys.path[:0] = ['z']\n"
                     "sys.path += ['w']\nsys.path = []\nprint(sys.path)\nfrom os import path\npath.join('a')\n")
    assert edits_sys_path(tree) == [2, 3, 4, 5, 6]


def test_nothing_edits_sys_path():
    found = {str(path.relative_to(ROOT)): lines for path in python_files()
             if (lines := edits_sys_path(ast.parse(path.read_text(), str(path))))}
    assert found == {}, "import the installed project (pip install -e .) instead of editing sys.path"


@pytest.mark.parametrize("path", [p for p in python_files() if len(p.read_text().splitlines()) > LONG],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_a_long_module_says_why_at_its_top(path):
    docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
    reasons = [s for s in docstring.split("\n\n") if "is long because" in s or "longer than" in s]
    assert len(reasons) == 1, f"{path.name}: say once, in its docstring, why it is over {LONG} lines"

"""The house's layering: ``pallas_kernels`` < ``minimax_jax`` < ``spec_decode``. A module may import its own
package and the packages below it, never one above; function-local imports count too (they are read from the
source, not from what happens to be imported at run time)."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAYERS = ("pallas_kernels", "minimax_jax", "spec_decode")


def imports_of(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, top-level package) of every import statement in the file, at any depth."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module.split(".")[0]))
    return out


@pytest.mark.parametrize("package", LAYERS[:-1])
def test_no_import_from_a_higher_package(package):
    higher = set(LAYERS[LAYERS.index(package) + 1:])
    bad = [f"{path.relative_to(ROOT)}:{line} imports {name}"
           for path in sorted((ROOT / package).rglob("*.py"))
           for line, name in imports_of(path) if name in higher]
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_the_check_sees_function_local_imports(tmp_path):
    sample = tmp_path / "m.py"
    sample.write_text("def f():\n    from spec_decode.engine import Engine\n    import spec_decode.step\n")
    assert [name for _, name in imports_of(sample)] == ["spec_decode", "spec_decode"]

"""The example notebooks run top to bottom on the CPU (nbclient), as a user would run them."""

import os

import nbformat
import pytest

nbclient = pytest.importorskip("nbclient")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _execute(name: str, tmp_path):
    """``examples/name`` executed in ``tmp_path``, its kernel importing this checkout (not whichever copy of the
    packages the interpreter has installed); returns the notebook and the text of its outputs."""
    nb = nbformat.read(os.path.join(ROOT, "examples", name), as_version=4)
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute(
        env={**os.environ, "PYTHONPATH": path})
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    return nb, outputs


def _images(nb) -> int:
    return sum("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))


def test_quickstart_notebook_executes(tmp_path):
    nb, outputs = _execute("quickstart.ipynb", tmp_path)
    assert "acceptance length" in outputs and "tokens/s" in outputs
    assert _images(nb) >= 1  # the plot


def test_adaptive_verification_notebook_executes(tmp_path):
    nb, outputs = _execute("adaptive_verification.ipynb", tmp_path)
    for text in ("cost table", "median relative spread", "draft length K_d", "calibration error", "tokens/s",
                 "greedy tokens identical in every mode"):
        assert text in outputs, text
    assert _images(nb) >= 4  # cost table, value curves, per-step plan, acceptance (and the calibrated one)

"""examples/notebook.ipynb runs top to bottom in a fresh kernel (a virtual mesh needs its own process)."""

from __future__ import annotations

from pathlib import Path

import pytest

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")
pytest.importorskip("ipykernel")

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "notebook.ipynb"


@pytest.mark.slow
def test_notebook_runs():
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    # The kernel starts in examples/, as Jupyter would start it, so the notebook imports gpt and data there.
    nbclient.NotebookClient(notebook, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    # Printed text arrives as streams; rich's drawings (visualize_sharding) as displays.
    text = "\n".join(out.get("text") or out.get("data", {}).get("text/plain", "")
                     for cell in notebook.cells if cell.cell_type == "code" for out in cell.get("outputs", []))
    assert "rank 3" in text and "[4:8, 4:8]" in text
    assert "collectives per step" in text and "COLLECTIVE" in text
    assert "Tensor (" in text and "val loss" in text

"""Package layering: what the recipe and the evaluator share lives below both."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "nemo_automodel_ext"


def imported_modules(folder: Path) -> set[tuple[str, str]]:
    """(file, module) for every ``nemo_automodel_ext`` import under ``folder``, module-level or not."""
    found = set()
    for path in sorted(folder.rglob("*.py")) if folder.is_dir() else [folder]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("nemo_automodel_ext"):
                found.add((path.name, node.module))
            elif isinstance(node, ast.Import):
                found.update(
                    (path.name, alias.name) for alias in node.names if alias.name.startswith("nemo_automodel_ext")
                )
    return found


@pytest.mark.parametrize(
    "folder,forbidden",
    [
        ("evaluation", ("nemo_automodel_ext.recipes",)),
        ("run", ("nemo_automodel_ext.recipes", "nemo_automodel_ext.evaluation")),
        ("models", ("nemo_automodel_ext.recipes", "nemo_automodel_ext.evaluation", "nemo_automodel_ext.run")),
        ("planning", ("nemo_automodel_ext.recipes", "nemo_automodel_ext.evaluation")),
    ],
)
def test_lower_packages_do_not_import_higher_ones(folder, forbidden):
    offending = sorted(
        (name, module) for name, module in imported_modules(PACKAGE / folder) if module.startswith(forbidden)
    )
    assert not offending, f"{folder}/ imports {offending}"


@pytest.mark.parametrize(
    "module,forbidden",
    [
        # resolve_checkpoint lives with the run record: the export no longer imports the evaluator's CLI.
        ("export.py", "nemo_automodel_ext.evaluation"),
        # The counts both use live in planning/counts.py: the calibration no longer imports the model it feeds.
        ("planning/calibration.py", "nemo_automodel_ext.planning.memory_model"),
    ],
)
def test_no_import_circles(module, forbidden):
    assert not [name for _, name in imported_modules(PACKAGE / module) if name.startswith(forbidden)]

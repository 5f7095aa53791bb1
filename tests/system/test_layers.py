"""The three rings' import rule: a5core knows nothing of Prefect, MLflow or DVC; flows call MLflow and define
Prefect tasks only through tasks/ (read from the source, every module, imports at any depth of the file)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def imported(path: Path) -> set[str]:
    """The top-level packages ``path`` imports, and the names it imports from ``prefect``."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
            if node.module.split(".")[0] == "prefect":
                found |= {f"prefect:{alias.name}" for alias in node.names}
    return found


@pytest.mark.parametrize("path", sorted((ROOT / "a5core").rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_library_imports_no_orchestration_or_tracking(path):
    assert not imported(path) & {"prefect", "mlflow", "dvc"}


@pytest.mark.parametrize("path", sorted((ROOT / "flows").glob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_flows_reach_mlflow_and_prefect_tasks_through_tasks(path):
    assert not imported(path) & {"mlflow", "prefect:task"}

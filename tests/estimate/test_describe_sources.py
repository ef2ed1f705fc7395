"""The describe cache's key covers pilotrun's code the describe role runs, read from the imports (never a list)."""
from __future__ import annotations

from pathlib import Path

from pilotrun.estimate import program_job
from pilotrun.estimate.program_job import _describers_digest, describer_sources

PACKAGE = Path(program_job.__file__).resolve().parents[1]


def _package(root: Path, files: dict[str, str]) -> Path:
    package = root / "pilotrun"
    for rel, text in {"__init__.py": "", "program/__init__.py": "", "integrations/__init__.py": "",
                      "models/__init__.py": "", "cli/__init__.py": "", **files}.items():
        (package / rel).parent.mkdir(parents=True, exist_ok=True)
        (package / rel).write_text(text)
    return package


def test_the_key_follows_what_the_describe_path_imports_and_nothing_else(tmp_path):
    package = _package(tmp_path, {
        "program/handle.py": "from . import env\n",
        "program/env.py": "",
        "program/describe.py": "def f():\n    from ..models.sizes import n  # lazy: it runs when describing\n",
        "models/sizes.py": "n = 1\n",
        "integrations/trainer.py": "from pilotrun.models import shapes\n",
        "models/shapes.py": "",
        "cli/run.py": "",
    })
    rel = {p.relative_to(package).as_posix() for p in describer_sources(package)}
    assert rel == {"__init__.py", "program/__init__.py", "program/handle.py", "program/env.py", "program/describe.py",
                   "models/__init__.py", "models/sizes.py", "integrations/__init__.py", "integrations/trainer.py",
                   "models/shapes.py"}
    first = _describers_digest(package)
    (package / "cli" / "run.py").write_text("x = 2\n")  # not on the describe path
    assert _describers_digest(package) == first
    (package / "models" / "sizes.py").write_text("n = 2\n")  # imported (lazily) by the describer
    changed = _describers_digest(package)
    assert changed != first
    (package / "integrations" / "newframework.py").write_text("from ..cli import run\n")  # a new integration
    grown = _describers_digest(package)
    assert grown != changed and "cli/run.py" in {p.relative_to(package).as_posix()
                                                 for p in describer_sources(package)}
    (package / "cli" / "run.py").write_text("x = 3\n")  # now imported by an integration: in the key
    assert _describers_digest(package) != grown


def test_the_real_describe_path_covers_every_integration_and_the_handle():
    sources = {p.relative_to(PACKAGE).as_posix() for p in describer_sources()}
    integrations = {p.relative_to(PACKAGE).as_posix() for p in (PACKAGE / "integrations").glob("*.py")}
    # The files the hand-written key listed, and what it had missed (fabric.py, loops.py, observe.py, copying.py).
    assert integrations | {"program/describe.py", "program/handle.py", "gates/view.py"} <= sources
    assert "cli/run.py" not in sources and "estimate/program_job.py" not in sources

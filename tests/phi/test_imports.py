"""phi's scalar modules are pure stdlib; only phi.vector imports numpy.

The agent imports phi and has a 40 MiB RSS budget; numpy alone costs ~14 MiB
(see phi/__init__.py). Each check runs in a fresh interpreter, since this test
process has long since imported numpy.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _imports_numpy(module: str) -> bool:
    code = f"import sys, {module}; print('numpy' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return done.stdout.strip() == "True"


@pytest.mark.parametrize("module", ["phi", "phi.detector", "phi.formulas", "phi.registry"])
def test_scalar_phi_modules_do_not_import_numpy(module: str) -> None:
    assert not _imports_numpy(module)


def test_vector_module_imports_numpy() -> None:
    # The probe itself must be able to see numpy.
    assert _imports_numpy("phi.vector")

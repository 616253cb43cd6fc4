"""The package type-checks: ``python -m mypy`` with the project's configuration (``[tool.mypy]``
in pyproject.toml) finds nothing in ``orbax_pathways`` and ``orbax_pathways_cli``.

Runs with every pytest run, so ``.ci/run`` checks the types at both ends of the supported range,
against the jax / numpy / tensorstore types installed there. mypy's cache (``.mypy_cache/`` at
the repository root, git-ignored) makes a rerun take well under a second; a cold run takes
about 10 s.
"""

import importlib.util
import pathlib
import sys

from support import procs
from support import REPO

ROOT = pathlib.Path(REPO)


def test_mypy_finds_no_errors():
  assert importlib.util.find_spec('mypy') is not None, (
      "mypy is not installed in this environment: pip install -e '.[test]'")
  proc = procs.run(
      [sys.executable, '-m', 'mypy', '--config-file', ROOT / 'pyproject.toml',
       '--cache-dir', ROOT / '.mypy_cache'],
      cwd=ROOT, devices=None, timeout=300, check=False)
  assert proc.returncode == 0, (
      f'mypy found type errors (exit {proc.returncode}); run `python -m mypy` at the repository '
      f'root to reproduce:\n{proc.stdout}{proc.stderr}')
  assert 'Success: no issues found' in proc.stdout, proc.stdout + proc.stderr

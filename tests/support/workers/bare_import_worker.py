"""Imports one module of the package without running ``orbax_pathways/__init__.py`` (which
installs the handler, hence imports jax and Orbax), then checks which heavy modules got loaded:
what a jax-free module needs is then all that is loaded. For ``tests/format/test_format.py``
(``test_format_imports_neither_jax_nor_tensorstore``) and ``tests/cli/test_cli_process.py``
(``test_cli_modules_import_no_jax``), through ``procs.run_worker``.

    python -m support.workers.bare_import_worker MODULE FORBIDDEN[,FORBIDDEN...]

Exits non-zero (an AssertionError naming them) if any module in ``FORBIDDEN`` was imported.
"""

from __future__ import annotations

import importlib
import os
import sys
import types


def main() -> None:
  from support import REPO  # pylint: disable=g-import-not-at-top

  module, forbidden = sys.argv[1], sys.argv[2].split(',')
  pkg = types.ModuleType('orbax_pathways')
  pkg.__path__ = [os.path.join(REPO, 'orbax_pathways')]
  sys.modules['orbax_pathways'] = pkg
  importlib.import_module(module)
  bad = sorted(m for m in forbidden if m in sys.modules)
  assert not bad, f'importing {module} loaded {bad}'


if __name__ == '__main__':
  main()

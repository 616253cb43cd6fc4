"""The CLI's ``show`` and ``verify`` of a step, in-process in a fresh interpreter without
``JAX_PLATFORMS``, for ``tests/cli/test_cli_process.py`` (``test_cli_never_initializes_a_backend``,
``procs.run_worker``).

    python -m support.workers.cli_no_backend_worker STEP_DIR

Exits non-zero unless ``show --json`` answers 0 and ``verify`` 3 (intact, the scalar 'step'
unchecked), and no jax backend was initialized.
"""

from __future__ import annotations

import sys


def main() -> None:
  from orbax_pathways.cli import main as cli  # pylint: disable=g-import-not-at-top

  step = sys.argv[1]
  assert cli.main(['show', step, '--json']) == 0
  assert cli.main(['verify', step]) == 3
  xb = sys.modules.get('jax._src.xla_bridge')
  assert xb is None or not xb.backends_are_initialized(), 'a jax backend was initialized'


if __name__ == '__main__':
  main()

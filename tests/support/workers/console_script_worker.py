"""The ``orbax-pathways`` console script's entry point (``orbax_pathways_cli.main``) run
in-process, for ``tests/cli/test_cli_process.py`` (``test_the_console_script_loads_no_jax``,
``procs.run_worker``): it imports the package without installing the handler.

    python -m support.workers.console_script_worker CKPT

Runs ``orbax-pathways ls CKPT`` (its table goes to stdout); exits non-zero unless it answers 0
and neither jax, jaxlib nor Orbax was loaded.
"""

from __future__ import annotations

import sys


def main() -> None:
  import orbax_pathways_cli  # pylint: disable=g-import-not-at-top

  sys.argv = ['orbax-pathways', 'ls', sys.argv[1]]
  assert orbax_pathways_cli.main() == 0
  bad = sorted(m for m in ('jax', 'jaxlib', 'orbax') if m in sys.modules)
  assert not bad, f'the CLI loaded {bad}'


if __name__ == '__main__':
  main()

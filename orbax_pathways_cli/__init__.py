"""The ``orbax-pathways`` console script: the inspection CLI without jax or Orbax.

``import orbax_pathways`` installs the handler, which imports jax and Orbax (about a second). The
CLI installs nothing and needs neither, so its script enters here and imports the package with
``ORBAX_PATHWAYS_DISABLE=1`` for this process (``python -m orbax_pathways`` runs the same CLI
after a normal, installing import).
"""

import os


def main() -> int:
  os.environ['ORBAX_PATHWAYS_DISABLE'] = '1'
  from orbax_pathways.cli import main as cli_main  # pylint: disable=g-import-not-at-top
  return cli_main.main()


if __name__ == '__main__':
  raise SystemExit(main())

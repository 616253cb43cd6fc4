"""``python -m orbax_pathways``: the inspection CLI (same as the ``orbax-pathways`` script)."""

from orbax_pathways.cli import main

if __name__ == '__main__':
  raise SystemExit(main.main())

"""What a directory holds, as a test compares it: every file below it, by its path relative to
the directory, with its bytes."""

from __future__ import annotations

import os


def contents(root) -> dict[str, bytes]:
  """Relative path -> bytes of every file below ``root`` (``{}`` when it holds none)."""
  out = {}
  for d, _, fs in os.walk(root):
    for f in fs:
      with open(os.path.join(d, f), 'rb') as fh:
        out[os.path.relpath(os.path.join(d, f), root)] = fh.read()
  return out

"""``orbax-pathways diff`` of two steps saved with different chunk grids (issue 21, item 8):
both sides have checksums, so the text must say why values were not compared (the grids
differ), not that checksums are missing."""

from __future__ import annotations

import contextlib
import io

from orbax_pathways.cli import main as cli_main

from support.arrays import mesh, random_state
from support.ckpt import save_with_options


def _diff(*argv) -> tuple[int, str]:
  out = io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
    code = cli_main.main([str(a) for a in argv])
  return code, out.getvalue()


def test_diff_of_steps_with_different_chunk_grids_says_the_grids_differ(tmp_path):
  state = random_state(mesh())
  save_with_options(tmp_path / 'a', state, 1)
  save_with_options(tmp_path / 'b', state, 1, max_chunk_bytes=1024, coalesce_bytes=0)
  code, out = _diff('diff', tmp_path / 'a' / '1', tmp_path / 'b' / '1')
  assert code == 0, out
  line = next(l for l in out.splitlines() if l.startswith('values not compared'))
  assert line.startswith('values not compared (4): default/opt.mu'), out
  # The three arrays have checksums on a different grid; the Python int has none anywhere.
  assert ('(chunk grids differ, so their checksums cannot be compared: 3; '
          'no orbax-pathways checksums on either side: 1; --values reads them)') in line, out
  assert 'on both sides' not in out, out
  code, out = _diff('diff', tmp_path / 'a' / '1', tmp_path / 'b' / '1', '--values')
  assert code == 0 and out.splitlines()[-1] == 'identical', out

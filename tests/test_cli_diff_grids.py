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
  line = next(l for l in out.splitlines()
               if l.startswith('values not compared') and 'default/params.w' in l)
  assert 'chunk grids differ' in line and '--values reads them' in line, out
  assert 'no orbax-pathways checksums' not in line, out
  # The Python int has no checksum on either side, and the text says so for it alone.
  step = next(l for l in out.splitlines() if 'default/step' in l)
  assert step.startswith('values not compared (1)') and 'on either side' in step, out
  code, out = _diff('diff', tmp_path / 'a' / '1', tmp_path / 'b' / '1', '--values')
  assert code == 0 and out.splitlines()[-1] == 'identical', out

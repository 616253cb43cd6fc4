"""``orbax-pathways diff`` says why values were not compared by checksum: it
said "no orbax-pathways checksums on both sides" for steps that both had checksums. Steps on
different chunk grids are now read and compared (``tests/cli/test_cli_diff.py``); what remains
uncompared without ``--values`` gets its reason, per leaf."""

from __future__ import annotations

import contextlib
import io
import json
import shutil

from orbax_pathways.format import records as records_lib
from orbax_pathways.cli import main as cli_main

from support.arrays import mesh, random_state
from support.ckpt import save, save_with_options


def _diff(*argv) -> tuple[int, str]:
  out = io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
    code = cli_main.main([str(a) for a in argv])
  return code, out.getvalue()


def test_diff_of_steps_with_different_chunk_grids_reads_them(tmp_path):
  state = random_state(mesh())
  save_with_options(tmp_path / 'a', state, 1)
  save_with_options(tmp_path / 'b', state, 1, max_chunk_bytes=1024, coalesce_bytes=0)
  code, out = _diff('diff', tmp_path / 'a' / '1', tmp_path / 'b' / '1')
  assert code == 0 and out.splitlines()[-1] == 'identical', out
  assert 'on both sides' not in out and 'values not compared' not in out, out


def test_diff_without_checksums_says_why(tmp_path):
  state = random_state(mesh())
  save(tmp_path / 'a', state, 1)
  save(tmp_path / 'b', state, 1)
  for step in (tmp_path / 'a' / '1', tmp_path / 'b' / '1'):
    for d in step.glob('*/' + records_lib.DIRNAME):
      shutil.rmtree(d)  # as stock Orbax writes them: no checksums anywhere
  code, out = _diff('diff', tmp_path / 'a' / '1', tmp_path / 'b' / '1')
  assert code == 0, out
  line = next(l for l in out.splitlines() if l.startswith('values not compared'))
  assert 'no orbax-pathways checksums on either side' in line and '--values reads them' in line
  assert 'on both sides' not in out, out
  code, out = _diff('diff', tmp_path / 'a' / '1', tmp_path / 'b' / '1', '--json')
  why = json.loads(out)['compared']['values_not_compared_why']
  assert why and set(why.values()) == {'no orbax-pathways checksums on either side'}, why
  code, out = _diff('diff', tmp_path / 'a' / '1', tmp_path / 'b' / '1', '--values')
  assert code == 0 and out.splitlines()[-1] == 'identical', out

"""The reference docs name only files that exist: a moved module or test leaves no stale path
behind in docs/ or the README (the CHANGELOG keeps the names a change had at the time)."""

import os
import re

from support import REPO

DOCS = ['README.md'] + sorted(f'docs/{n}' for n in os.listdir(os.path.join(REPO, 'docs'))
                              if n.endswith('.md'))
# `path.py` in backquotes: a file of this repository, written from its root or from one of the
# folders a doc speaks from.
NAMED = re.compile(r'`([A-Za-z0-9_.][A-Za-z0-9_./-]*\.(?:py|md|sh|toml|txt|json))`')
BASES = ('', 'orbax_pathways/', 'docs/', 'benchmarks/', 'tests/', 'integration/', '.ci/')
# Files a checkpoint directory holds (Orbax's commit marker, the writer lease), not ours here.
IN_CHECKPOINTS = {'commit_success.txt', 'orbax-pathways-lease.json'}


def _missing(text: str, repo: str = REPO) -> list[str]:
  return sorted({m for m in NAMED.findall(text) if m not in IN_CHECKPOINTS
                 and not any(os.path.exists(os.path.join(repo, b + m)) for b in BASES)})


def test_every_file_the_docs_name_exists():
  found = {}
  for doc in DOCS:
    with open(os.path.join(REPO, doc), encoding='utf-8') as f:
      found[doc] = _missing(f.read())
  assert {d: m for d, m in found.items() if m} == {}


def test_the_check_sees_a_stale_path():
  text = ('the index codec is in `orbax_pathways/metadata.py`, the store in `tier/store.py`, '
          'the lease in `orbax-pathways-lease.json`')
  assert _missing(text) == ['orbax_pathways/metadata.py']

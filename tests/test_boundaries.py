"""The layering docs/architecture.md promises, checked on the source (what an import-linter
contract would check): who may import what."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / 'orbax_pathways'


def _modules():
  return sorted(p for p in PACKAGE.rglob('*.py'))


def _imports(path: pathlib.Path) -> set[str]:
  """Every module name ``path`` imports (also inside functions)."""
  tree = ast.parse(path.read_text(), str(path))
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      out.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      out.add(node.module)
      out.update(f'{node.module}.{a.name}' for a in node.names)
  return out


def _rel(path):
  return path.relative_to(PACKAGE).as_posix()


def test_only_compat_reaches_private_orbax_and_jax():
  offenders = {
      _rel(p): sorted(m for m in _imports(p)
                      if m.startswith(('orbax.checkpoint._src', 'orbax.checkpoint.experimental.v1._src',
                                       'jax._src')))
      for p in _modules() if not _rel(p).startswith('_compat/')}
  assert {k: v for k, v in offenders.items() if v} == {}


def test_one_compat_module_imports_private_modules():
  """Inside _compat/ too, only _compat/src.py imports ``_src`` modules; the rest ask it by path
  (``src.orbax('path.deleter')``), so a moved Orbax or JAX module has one place to change."""
  private = ('orbax.checkpoint._src', 'orbax.checkpoint.experimental.v1._src', 'jax._src')
  offenders = {_rel(p): sorted(m for m in _imports(p) if m.startswith(private))
               for p in _modules() if _rel(p).startswith('_compat/') and _rel(p) != '_compat/src.py'}
  assert {k: v for k, v in offenders.items() if v} == {}


def test_compat_src_finds_modules_and_attributes_and_names_what_moved():
  from orbax_pathways._compat import src  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint._src.path.deleter as deleter  # pylint: disable=g-import-not-at-top
  from orbax.checkpoint._src.asyncio_utils import run_sync  # pylint: disable=g-import-not-at-top
  assert src.orbax('path.deleter') is deleter
  assert src.orbax('asyncio_utils.run_sync') is run_sync
  with pytest.raises(ModuleNotFoundError, match=r'orbax\.checkpoint\._src\.path\.no_such'):
    src.orbax('path.no_such')


def _private_reads(path: pathlib.Path) -> list[str]:
  """``x._name`` reads on anything but ``self``/``cls`` and the stdlib's ``os``/``sys``."""
  out = []
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if (isinstance(node, ast.Attribute) and node.attr.startswith('_')
        and not node.attr.startswith('__')):
      base = node.value.id if isinstance(node.value, ast.Name) else None
      if base not in ('self', 'cls', 'os', 'sys'):
        out.append(f'{ast.unparse(node)} (line {node.lineno})')
  return out


def test_only_compat_reads_private_attributes():
  """Reading Orbax's (or anyone's) private attributes happens in _compat only."""
  offenders = {_rel(p): _private_reads(p) for p in _modules() if not _rel(p).startswith('_compat/')}
  assert {k: v for k, v in offenders.items() if v} == {}


@pytest.mark.parametrize('layer,forbidden', [
    ('plan/', ('jax', 'tensorstore', 'orbax', 'etils', 'orbax_pathways.storage',
               'orbax_pathways.transports', 'orbax_pathways.engine')),
    ('storage/', ('jax', 'orbax', 'orbax_pathways.transports', 'orbax_pathways.engine',
                  'orbax_pathways.frontends')),
    ('cli/', ('jax', 'orbax_pathways.engine', 'orbax_pathways.transports',
              'orbax_pathways.frontends')),
    ('transports/', ('orbax_pathways.engine', 'orbax_pathways.frontends',
                     'orbax_pathways._registration')),
    ('engine.py', ('orbax_pathways.frontends', 'orbax_pathways._registration')),
    ('values.py', ('jax', 'orbax', 'orbax_pathways.transports', 'orbax_pathways.engine')),
])
def test_layers_do_not_import_upwards(layer, forbidden):
  offenders = {}
  for p in _modules():
    if not _rel(p).startswith(layer):
      continue
    bad = sorted(m for m in _imports(p) if any(m == f or m.startswith(f + '.') for f in forbidden))
    if bad:
      offenders[_rel(p)] = bad
  assert offenders == {}


def _package_graph() -> dict[str, set[str]]:
  """orbax_pathways module -> the orbax_pathways modules it imports (also inside functions and
  under TYPE_CHECKING)."""
  names = {_rel(p)[:-3].replace('/', '.').removesuffix('.__init__'): p for p in _modules()}
  graph: dict[str, set[str]] = {}
  for name, p in names.items():
    deps = set()
    for m in _imports(p):
      if m.startswith('orbax_pathways.'):
        short = m[len('orbax_pathways.'):]
        while short and short not in names:
          short = short.rpartition('.')[0]
        if short and short != name:
          deps.add(short)
    graph[name] = deps
  return graph


@pytest.mark.parametrize('a,b', [('format', 'metadata'), ('transports.base', 'transports.local'),
                                 ('transports.base', 'transports.colocated'),
                                 ('transports.base', 'transports.persistence')])
def test_no_import_circle(a, b):
  """Issue 20's house-keeping: format <-> metadata (through chunk_index) and transports.base
  <-> the concrete transports (through create) no longer import each other."""
  graph = _package_graph()
  assert not (b in graph[a] and a in graph[b]), (a, sorted(graph[a]), b, sorted(graph[b]))

"""The layering docs/architecture.md promises, checked on the source (what an import-linter
contract would check): who may import what."""

import ast
import pathlib

import pytest
from support import REPO

PACKAGE = pathlib.Path(REPO) / 'orbax_pathways'


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


def _private_reaches(path: pathlib.Path) -> list[str]:
  """The reaches ``x._name`` does not show: ``getattr``/``setattr``/``hasattr``/``delattr`` of a
  private name given as a string, and any ``x.__dict__`` but ``self``'s."""
  out = []
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
        and node.func.id in ('getattr', 'setattr', 'hasattr', 'delattr') and len(node.args) >= 2
        and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
        and node.args[1].value.startswith('_') and not node.args[1].value.startswith('__')):
      out.append(f'{ast.unparse(node)} (line {node.lineno})')
    elif (isinstance(node, ast.Attribute) and node.attr == '__dict__'
          and not (isinstance(node.value, ast.Name) and node.value.id == 'self')):
      out.append(f'{ast.unparse(node)} (line {node.lineno})')
  return out


def test_only_compat_reads_private_attributes():
  """Reading Orbax's (or anyone's) private attributes happens in _compat only, whether written
  ``x._name``, ``getattr(x, '_name')`` or through ``x.__dict__``."""
  offenders = {_rel(p): _private_reads(p) + _private_reaches(p)
               for p in _modules() if not _rel(p).startswith('_compat/')}
  assert {k: v for k, v in offenders.items() if v} == {}


KV_METHODS = {'key_value_set', 'key_value_try_get', 'blocking_key_value_get',
              'key_value_dir_get', 'key_value_delete', 'wait_at_barrier'}
# Orbax's own signal keys, which the package marks failed in Orbax's format (not the package's).
KV_OUTSIDE_ROUNDS = {'_compat/orbax_signals.py'}


def _kv_calls(path: pathlib.Path) -> list[str]:
  return [f'{ast.unparse(node.func)} (line {node.lineno})'
          for node in ast.walk(ast.parse(path.read_text(), str(path)))
          if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
          and node.func.attr in KV_METHODS]


def test_key_value_keys_and_waits_are_in_coord_rounds_only():
  """Every key the package publishes in jax's key-value store, and every wait on one, goes
  through ``coord/rounds.py``: a call of the client's methods anywhere else is found."""
  offenders = {_rel(p): _kv_calls(p) for p in _modules()
               if _rel(p) not in {'coord/rounds.py', *KV_OUTSIDE_ROUNDS}}
  assert {k: v for k, v in offenders.items() if v} == {}
  assert _kv_calls(PACKAGE / 'coord' / 'rounds.py')  # the check sees the calls it looks for


def test_the_private_reach_check_sees_every_form(tmp_path):
  """The check above is not blind: each form it looks for is found in a sample."""
  sample = tmp_path / 'sample.py'
  sample.write_text('a = m._x\nb = getattr(m, "_y")\nsetattr(m, "_z", 1)\nc = m.__dict__\n'
                    'd = self.__dict__\ne = getattr(m, "__name__")\n')
  found = _private_reads(sample) + _private_reaches(sample)
  assert [f.split(' (line')[0] for f in found] == [
      'm._x', "getattr(m, '_y')", "setattr(m, '_z', 1)", 'm.__dict__']


@pytest.mark.parametrize('layer,forbidden', [
    ('plan/', ('jax', 'tensorstore', 'orbax', 'etils')),
    ('format/', ('jax', 'tensorstore', 'orbax', 'etils')),
    ('coord/', ('jax', 'tensorstore', 'orbax', 'etils')),
    ('storage/', ('jax', 'orbax')),
    ('tier/', ('jax', 'orbax')),
    ('peer/', ('jax', 'orbax')),
    ('fleet/', ('jax', 'orbax')),
    ('cli/', ('jax', 'orbax_pathways.engine', 'orbax_pathways.transports',
              'orbax_pathways.frontends', 'orbax_pathways.sharding', 'orbax_pathways.manager')),
    ('transports/values.py', ('jax', 'orbax')),
])
def test_pure_and_jax_free_layers(layer, forbidden):
  """What docs/architecture.md promises beyond the layer order: the pure layers import no
  tensorstore, Orbax or jax; storage, the tier and the CLI no jax (the CLI no engine either)."""
  offenders = {}
  for p in _modules():
    if not _rel(p).startswith(layer):
      continue
    bad = sorted(m for m in _imports(p) if any(m == f or m.startswith(f + '.') for f in forbidden))
    if bad:
      offenders[_rel(p)] = bad
  assert offenders == {}


# The layers of docs/architecture.md, bottom first: a module may import modules of its own layer
# and of the layers below, never above. Every module of the package is in exactly one.
LAYERS = (
    ('base', ('errors', 'options', 'version', 'stats', '_util')),
    ('plan', ('plan',)),
    ('format', ('format',)),
    ('coord', ('coord',)),
    ('storage', ('storage',)),
    ('tier', ('tier',)),
    ('peer', ('peer',)),
    ('fleet', ('fleet',)),
    ('compat', ('_compat',)),
    ('sharding', ('sharding',)),
    ('transports', ('transports',)),
    ('engine', ('engine',)),
    ('frontends', ('frontends',)),
    ('manager', ('manager',)),
    ('multitier', ('multitier',)),
    ('preemption', ('preemption',)),
    ('top', ('', '_install', '__main__', 'cli')),
)


def _layer(module: str) -> int:
  """The layer of a module (``tier.store``: 'tier'; the root package itself: 'top')."""
  head = module.split('.', 1)[0]
  for i, (_, heads) in enumerate(LAYERS):
    if head in heads:
      return i
  raise AssertionError(f'orbax_pathways.{module} is in no layer of LAYERS: add it to one')


def _package_imports(path: pathlib.Path, names: set[str]) -> set[str]:
  """The package modules ``path`` imports (``names``: every module, the root package ``''``).
  ``from orbax_pathways.x import y`` is an import of ``x.y`` when that is a module, else of
  ``x`` (a name defined there); ``import orbax_pathways.x.y`` of ``x.y``."""

  def module_of(dotted: str) -> str | None:
    if dotted != 'orbax_pathways' and not dotted.startswith('orbax_pathways.'):
      return None
    short = dotted[len('orbax_pathways.'):] if dotted != 'orbax_pathways' else ''
    while short and short not in names:
      short = short.rpartition('.')[0]
    return short

  out = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      found = [module_of(a.name) for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      found = []
      for a in node.names:
        sub = module_of(f'{node.module}.{a.name}')
        whole = module_of(node.module)
        found.append(sub if sub is not None and sub != whole else whole)
    else:
      continue
    out.update(m for m in found if m is not None)
  return out


def _package_graph() -> dict[str, set[str]]:
  """orbax_pathways module -> the orbax_pathways modules it imports (also inside functions and
  under TYPE_CHECKING; the root package is ``''``)."""
  paths = {_rel(p)[:-3].replace('/', '.').removesuffix('__init__').rstrip('.'): p
           for p in _modules()}
  return {name: _package_imports(p, set(paths)) - {name} for name, p in paths.items()}


def test_every_import_goes_down_the_layers():
  """The whole import graph (every module, every import, also inside functions), not listed
  pairs: nothing imports a layer above its own."""
  graph = _package_graph()
  up = {f'{m} ({LAYERS[_layer(m)][0]})': sorted(f'{d} ({LAYERS[_layer(d)][0]})' for d in deps
                                               if _layer(d) > _layer(m))
        for m, deps in graph.items()}
  assert {k: v for k, v in up.items() if v} == {}


# Package-level circles known and not yet ended, each with the change that ends it. A new one
# fails the test below; one that is gone must be struck from here.
KNOWN_PACKAGE_CIRCLES: set[frozenset[str]] = set()


def test_no_package_circle_beyond_the_known_ones():
  """Packages (``manager``, ``tier``, ...) import each other without a circle, which the module
  graph's check cannot see when the modules involved differ; the known ones are listed."""
  graph = _package_graph()
  packages: dict[str, set[str]] = {}
  for m, deps in graph.items():
    head = m.split('.')[0]
    packages.setdefault(head, set()).update(d.split('.')[0] for d in deps if d.split('.')[0] != head)
  reach: dict[str, set[str]] = {}
  for start in packages:
    seen, todo = set(), list(packages[start])
    while todo:
      p = todo.pop()
      if p not in seen:
        seen.add(p)
        todo.extend(packages.get(p, ()))
    reach[start] = seen
  circles = {frozenset({a, b}) for a in packages for b in reach[a] if a != b and a in reach[b]}
  assert circles == KNOWN_PACKAGE_CIRCLES


def test_no_import_circle():
  """No module reaches itself through its imports (the whole graph: strongly connected
  components, Tarjan's)."""
  graph = _package_graph()
  index: dict[str, int] = {}
  low: dict[str, int] = {}
  stack: list[str] = []
  on_stack: set[str] = set()
  circles: list[list[str]] = []
  counter = [0]

  def visit(v: str) -> None:
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on_stack.add(v)
    for w in graph.get(v, ()):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        circles.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  assert circles == []


def test_no_two_modules_share_a_name():
  """``sharding/layout.py`` beside ``tier/manifest.py`` made a reader ask which one an import means: every
  module file name is unique in the package (``__init__.py`` aside)."""
  seen: dict[str, list[str]] = {}
  for p in _modules():
    if p.name != '__init__.py':
      seen.setdefault(p.name, []).append(_rel(p))
  assert {k: v for k, v in seen.items() if len(v) > 1} == {}


def test_the_root_holds_only_the_public_surface():
  """The package root: the public surface (install, Options, errors, stats, preemption) and the
  private module that implements install(); everything else lives in a subpackage."""
  root = sorted(p.name for p in PACKAGE.iterdir()
                if p.name != '__pycache__' and (p.suffix == '.py' or p.is_dir()))
  assert root == sorted(['__init__.py', '__main__.py', '_install.py', 'errors.py', 'options',
                         'stats.py', 'version.py', '_compat', '_util', 'cli', 'coord', 'engine',
                         'fleet', 'format', 'frontends', 'manager', 'multitier', 'peer', 'plan',
                         'preemption', 'sharding',
                         'storage', 'tier', 'transports'])


def test_process_wide_state_is_rare():
  """At most 10 ``global`` statements in the package: a module's process-wide state lives in
  one object of its own (``_state``), set through its attributes."""
  found = [f'{_rel(p)}:{node.lineno}' for p in _modules()
           for node in ast.walk(ast.parse(p.read_text(), str(p))) if isinstance(node, ast.Global)]
  assert len(found) <= 10, found

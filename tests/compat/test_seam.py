"""The one seam into Orbax (``_compat/seam.py``): every target the package declares exists in
the installed Orbax, and a release that lacks one turns off exactly the feature that needs it,
with one warning naming the attribute and the feature, and leaves Orbax as it is there."""

from __future__ import annotations

import logging
import types

import pytest

import orbax_pathways  # pylint: disable=unused-import  (installs every feature)
from orbax_pathways._compat import orbax_process_local
from orbax_pathways._compat import seam
from support import procs
from support.workers import moved_target_worker


def test_every_declared_target_is_in_the_installed_orbax():
  """Conformance: each feature the package installs (and node steps' own, installed at their
  first use) finds every required target, and none is off."""
  features = {f.name: f for f in seam.declared()}
  features[orbax_process_local.FEATURE.name] = orbax_process_local.FEATURE
  assert len(features) >= 13, sorted(features)
  for feature in features.values():
    found, missing = seam.resolve(feature)
    assert missing == [], (feature.name, missing)
    assert found, feature.name
  assert seam.off() == {}


@pytest.fixture
def own_seam(monkeypatch):
  """The sample features below live in a seam state of their own, not among the package's."""
  monkeypatch.setattr(seam, '_state', seam._State())  # pylint: disable=protected-access


def _sample(attrs):
  owner = type('Owner', (), {a: staticmethod(lambda a=a: f'own {a}') for a in attrs})
  return owner, seam.Feature(
      'a sample feature', 'for the test',
      lambda: [seam.Target(lambda: owner, 'first', lambda f: lambda: 'ours ' + f()),
               seam.Target(lambda: owner, 'second', lambda f: lambda: 'ours ' + f()),
               seam.Target(lambda: owner, 'extra', lambda f: lambda: 'ours', optional=True)])


def test_a_missing_target_turns_its_feature_off_with_one_warning_and_touches_nothing(caplog, own_seam):
  owner, feature = _sample(['first'])  # 'second' missing, 'extra' optional
  before = vars(owner).copy()
  caplog.set_level(logging.WARNING, logger='orbax_pathways')
  assert seam.install(feature) is False
  assert seam.install(feature) is False  # said once
  assert vars(owner) == before  # all or none: 'first' is Orbax's own
  assert list(seam.off()) == ['a sample feature']
  (record,) = [r for r in caplog.records if 'a sample feature' in r.getMessage()]
  text = record.getMessage()
  assert text.startswith('orbax_pathways: test_seam.Owner.second not found'), text
  assert 'a sample feature is off, and Orbax behaves there as without the package' in text, text
  seam.uninstall(feature)
  assert seam.off() == {}


def test_a_feature_is_applied_whole_and_given_back(own_seam):
  owner, feature = _sample(['first', 'second'])
  before = vars(owner).copy()
  assert seam.install(feature) and seam.installed(feature)
  assert (owner.first(), owner.second()) == ('ours own first', 'ours own second')
  assert not hasattr(owner, 'extra')  # optional and absent: skipped
  assert seam.originals(feature) == {'first': before['first'], 'second': before['second']}
  seam.uninstall(feature)
  assert vars(owner) == before and not seam.installed(feature)


def test_an_added_attribute_is_removed_again(own_seam):
  owner = types.SimpleNamespace()
  feature = seam.Feature('an added one', 'for the test',
                         lambda: [seam.Target(lambda: owner, 'new', lambda none: 'ours',
                                              add=True)])
  assert seam.install(feature) and owner.new == 'ours'
  seam.uninstall(feature)
  assert not hasattr(owner, 'new')


def test_an_orbax_whose_patched_method_moved_keeps_working_stock(tmp_path):
  """A release where ``CheckpointManager.reached_preemption`` moved to a base class: the
  import does not raise, one warning names it and the CheckpointManager hooks, every other
  method of the class stays Orbax's own (no half-applied patch), and a save and restore with
  the package's handler works."""
  got = procs.worker_json(moved_target_worker, tmp_path / 'ckpt', fresh=True, timeout=240)
  assert list(got['off']) == [next(f for f in got['off'] if 'CheckpointManager hooks' in f)]
  (missing,) = next(iter(got['off'].values()))
  assert missing.endswith('CheckpointManager.reached_preemption'), got
  assert got['stock'] == {'save': True, 'restore': True, '_finalize': True, '__init__': True}
  mentions = [w for w in got['warnings'] if 'reached_preemption' in w]
  assert len(mentions) == 1 and 'the CheckpointManager hooks' in mentions[0], got['warnings']
  assert got['equal'] is True


def test_the_architecture_doc_lists_every_target():
  """``docs/architecture.md``'s table of patches names every target of every feature."""
  import pathlib  # pylint: disable=g-import-not-at-top
  doc = (pathlib.Path(procs.REPO) / 'docs' / 'architecture.md').read_text()
  features = {f.name: f for f in seam.declared()}
  features[orbax_process_local.FEATURE.name] = orbax_process_local.FEATURE
  for feature in features.values():
    assert f'| {feature.name} |' in doc, feature.name
    for _, target in seam.resolve(feature)[0]:
      assert f'.{target.attr}`' in doc, (feature.name, target.attr)

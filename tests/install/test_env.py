"""Every ORBAX_PATHWAYS_* variable is parsed at install (import) with an error naming the variable,
the value and what is accepted."""

from __future__ import annotations

import pathlib
import re
import sys

import jax
import orbax.checkpoint as ocp
import pytest

import orbax_pathways
from orbax_pathways import options as options_lib
from orbax_pathways.engine import runtime

from support import procs

OUT_OF_RANGE = r'is out of range: it must be '
BOOL_ERROR = r"is not a boolean: one of \['1', 'true', 'yes', 'y', 'on', 't'\] or \['0', 'false'"


@pytest.mark.parametrize('name,value,message', [
    ('ORBAX_PATHWAYS_VERIFY', 'maybe', BOOL_ERROR),
    ('ORBAX_PATHWAYS_VERIFY', 'enabled', BOOL_ERROR),
    ('ORBAX_PATHWAYS_GCS_GRPC', 'si', BOOL_ERROR),
    ('ORBAX_PATHWAYS_NO_SIGTERM', 'please', BOOL_ERROR),
    ('ORBAX_PATHWAYS_TRANSPORT', 'bogus',
     r"is not one of \['in_process', 'colocated', 'persistence'\]\. Unset it to auto-detect"),
    ('ORBAX_PATHWAYS_RUNTIME', 'tpu', r"is not one of \['single', 'multi_controller'"),
    ('ORBAX_PATHWAYS_SNAPSHOT', 'gpu', r"is not one of \['auto', 'pinned', 'host'\]"),
    ('ORBAX_PATHWAYS_COMPRESSION', 'gzip', r"is not one of \['auto', 'zstd', 'none'\]"),
    ('ORBAX_PATHWAYS_DIVISIBILITY', 'pad', r"is not one of \['replicate', 'strict'\]"),
    ('ORBAX_PATHWAYS_NUM_SLICES', 'abc', r'is not an integer >= 1'),
    ('ORBAX_PATHWAYS_NUM_SLICES', '0', OUT_OF_RANGE + r'an integer >= 1'),
    ('ORBAX_PATHWAYS_NUM_SLICES', '-2', OUT_OF_RANGE + r'an integer >= 1'),
    ('ORBAX_PATHWAYS_STORAGE_RETRIES', 'x', r"is not an integer >= 0\. Unset it to keep "
                                            r"tensorstore's default"),
    ('ORBAX_PATHWAYS_STORAGE_RETRIES', '-1', OUT_OF_RANGE + r'an integer >= 0'),
    ('ORBAX_PATHWAYS_MAX_INFLIGHT_BYTES', '0', OUT_OF_RANGE + r'an integer >= 1 \(bytes\)'),
    ('ORBAX_PATHWAYS_MAX_INFLIGHT_BYTES', '-5', OUT_OF_RANGE + r'an integer >= 1 \(bytes\)'),
    ('ORBAX_PATHWAYS_MAX_CHUNK_BYTES', '16MiB', r'is not an integer >= 1 \(bytes\)'),
    ('ORBAX_PATHWAYS_COALESCE_BYTES', '-1', OUT_OF_RANGE + r'an integer >= 0 \(bytes\)'),
    ('ORBAX_PATHWAYS_SIGTERM_GRACE_S', '0', OUT_OF_RANGE + r'a number >= 0.001 \(seconds'),
    ('ORBAX_PATHWAYS_SIGTERM_GRACE_S', 'nan', OUT_OF_RANGE + r'a number >= 0.001 \(seconds'),
    ('ORBAX_PATHWAYS_DISABLE', 'sometimes', BOOL_ERROR),
])
def test_malformed_variable_fails_install_naming_it(monkeypatch, name, value, message):
  monkeypatch.setenv(name, value)
  with pytest.raises(ValueError, match=rf'{name}={value!r} {message}'):
    orbax_pathways.install()
  with pytest.raises(ValueError, match=rf'{name}={value!r}'):
    options_lib.parse_env()


@pytest.mark.parametrize('value,expected', [
    ('1', True), ('true', True), ('YES', True), ('Y', True), ('on', True), (' t ', True),
    ('0', False), ('False', False), ('no', False), ('N', False), ('OFF', False), ('f', False),
    ('', True),  # set but empty: the default
])
def test_booleans_accept_the_usual_spellings(monkeypatch, value, expected):
  monkeypatch.setenv('ORBAX_PATHWAYS_VERIFY', value)
  assert options_lib.Options.from_env().verify_checksums is expected
  handler = orbax_pathways.install(options_lib.Options.from_env())
  assert handler.options.verify_checksums is expected


def test_valid_values_are_typed_and_case_insensitive(monkeypatch):
  monkeypatch.setenv('ORBAX_PATHWAYS_TRANSPORT', 'In_Process')
  monkeypatch.setenv('ORBAX_PATHWAYS_STORAGE_RETRIES', ' 3 ')
  monkeypatch.setenv('ORBAX_PATHWAYS_NUM_SLICES', '4')
  monkeypatch.setenv('ORBAX_PATHWAYS_SIGTERM_GRACE_S', 'inf')
  o = options_lib.Options.from_env()
  assert (o.transport, o.storage_retries, o.num_slices) == ('in_process', 3, 4)
  assert options_lib.num_slices_from_env() == 4
  assert options_lib.env_value('ORBAX_PATHWAYS_SIGTERM_GRACE_S') == float('inf')
  assert runtime.choose_transport() is runtime.TransportName.IN_PROCESS


def test_every_accepted_transport_name_builds_that_transport():
  """One list of names (``options.TransportName``): what the options accept, what the runtime
  picks and what the registry builds."""
  from orbax_pathways.transports import registry  # pylint: disable=g-import-not-at-top
  assert options_lib.TRANSPORTS == ('in_process', 'colocated', 'persistence')
  assert options_lib.RUNTIMES == ('single', 'multi_controller', 'pathways')
  assert runtime.TransportName is options_lib.TransportName
  for name in options_lib.TRANSPORTS:
    assert registry.create(name).name == name
    assert runtime.choose_transport(requested=name) == name
  with pytest.raises(ValueError, match=r"Unknown transport 'bogus'; valid transports: "
                                       r"\['in_process', 'colocated', 'persistence'\]"):
    registry.create('bogus')


def test_options_reject_bad_values_directly():
  for kwargs, message in [
      ({'max_inflight_bytes': 0}, r'Options.max_inflight_bytes=0: must be an integer >= 1'),
      ({'num_slices': 0}, r'Options.num_slices=0: must be an integer >= 1 or None'),
      ({'storage_retries': -1}, r'Options.storage_retries=-1: must be an integer >= 0'),
      ({'transport': 'bogus'}, r"Options.transport='bogus': use one of \['in_process', 'colocated', "
                               r"'persistence'\], or None to detect"),
      ({'local_save_when_busy': 'drop'}, r"local_save_when_busy='drop': use 'wait' or 'skip'"),
  ]:
    with pytest.raises(ValueError, match=message):
      options_lib.Options(**kwargs)
  with pytest.raises(ValueError, match=r"transport='bogus' is not one of"):
    runtime.choose_transport(requested='bogus')


def test_unknown_variable_is_warned_about_with_the_closest_name(monkeypatch):
  monkeypatch.setenv('ORBAX_PATHWAYS_VERFY', '0')
  with pytest.warns(RuntimeWarning, match=r"unknown environment variable ORBAX_PATHWAYS_VERFY='0' "
                                          r'is ignored\. Did you mean ORBAX_PATHWAYS_VERIFY\?'):
    orbax_pathways.install()


@pytest.mark.parametrize('name', ['ORBAX_PATHWAY_VERIFY', 'orbax_pathways_verify',
                                  'ORBAXPATHWAYS_VERIFY', 'OBRAX_PATHWAYS_VERIFY'])
def test_near_miss_of_a_known_name_is_warned_about(monkeypatch, name):
  monkeypatch.setenv(name, '0')
  with pytest.warns(RuntimeWarning, match=rf"unknown environment variable {name}='0' is ignored\. "
                                          r'Did you mean ORBAX_PATHWAYS_VERIFY\?'):
    orbax_pathways.install()
  assert orbax_pathways.installed().options.verify_checksums is True  # really ignored


def test_other_programs_variables_are_not_ours(monkeypatch):
  for name in ('PATHWAYS_TRANSPORT', 'PATHWAYS_VERIFY', 'ORBAX_USE_OCDBT', 'JAX_PLATFORMS'):
    monkeypatch.setenv(name, 'x')
  assert options_lib.unknown_env() == {}


def test_every_variable_the_package_reads_is_known(monkeypatch):
  """A variable the code reads outside ``Options`` (the tier's mapping switch, which the docs
  tell users to set) is never reported as ignored."""
  names = set()
  root = pathlib.Path(orbax_pathways.__file__).parent
  for path in root.rglob('*.py'):
    names |= set(re.findall(r"'(ORBAX_PATHWAYS_[A-Z0-9_]+)'", path.read_text()))
  assert names, root
  for name in names:
    monkeypatch.setenv(name, '0')
  assert options_lib.unknown_env() == {}


def test_misspelled_variable_is_warned_about_once_at_import():
  r = procs.run([sys.executable, '-c', 'import orbax_pathways; orbax_pathways.install(); '
                 'orbax_pathways.install()'],
                env={'ORBAX_PATHWAY_VERIFY': '0', 'ORBAX_PATHWAYS_VERIFI': '0'}, devices=None)
  for name in ('ORBAX_PATHWAY_VERIFY', 'ORBAX_PATHWAYS_VERIFI'):
    assert r.stderr.count(f'unknown environment variable {name}=') == 1, r.stderr[-3000:]
  assert r.stderr.count('Did you mean ORBAX_PATHWAYS_VERIFY?') == 2


def test_num_slices_that_does_not_divide_the_devices_fails_at_manager_construction(
    tmp_path, monkeypatch):
  assert len(jax.devices()) == 8
  monkeypatch.setenv('ORBAX_PATHWAYS_NUM_SLICES', '3')
  orbax_pathways.install(options_lib.Options.from_env())
  with pytest.raises(ValueError, match=r'ORBAX_PATHWAYS_NUM_SLICES=3 does not divide the 8 '
                                       r'devices of this job into equal slices'):
    ocp.CheckpointManager(tmp_path)
  monkeypatch.setenv('ORBAX_PATHWAYS_NUM_SLICES', '4')
  orbax_pathways.install(options_lib.Options.from_env())
  ocp.CheckpointManager(tmp_path).close()


def test_import_fails_at_once_on_a_malformed_variable():
  r = procs.run([sys.executable, '-c', 'import orbax_pathways'],
                env={'ORBAX_PATHWAYS_VERIFY': 'maybe'}, devices=None, check=False)
  assert r.returncode == 1, r.stderr[-3000:]
  assert ("ValueError: orbax_pathways: invalid environment: ORBAX_PATHWAYS_VERIFY='maybe' is not "
          'a boolean') in r.stderr


def test_every_option_field_has_its_variable_and_takes_its_default_from_it():
  """The defaults are written once (``options.FIELD_ENV`` into ``ENV_VARS``): unset variables
  give exactly ``Options()``, and each variable sets its field."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  from orbax_pathways import options as options_lib  # pylint: disable=g-import-not-at-top
  fields = {f.name: f.default for f in dataclasses.fields(options_lib.Options)}
  assert set(fields) - set(options_lib.FIELD_ENV) == {'replica_parallel'}
  assert set(options_lib.FIELD_ENV.values()) <= set(options_lib.ENV_VARS)
  for field, name in options_lib.FIELD_ENV.items():
    assert fields[field] == options_lib.ENV_VARS[name].default, field
  assert options_lib.Options.from_env({}) == options_lib.Options()
  assert options_lib.Options.from_env(
      {'ORBAX_PATHWAYS_TIER_KEEP': '3', 'ORBAX_PATHWAYS_PEER_TIMEOUT_S': '7.5',
       'ORBAX_PATHWAYS_LOCAL_STEPS_KEEP': '4'}) == \
      options_lib.Options(tier_keep=3, peer_timeout_s=7.5, local_steps_keep=4)


def test_former_option_names_still_work_with_a_deprecation_warning(monkeypatch):
  """The tier's options were ``local_*`` and the in-process transport ``'local'``: those names
  still set the same option (keyword, attribute, variable), each with a DeprecationWarning
  naming the new one; the new variable wins where both are set."""
  with pytest.warns(DeprecationWarning, match=r'Options.local_dir is now Options.tier_dir'):
    o = options_lib.Options(local_dir='/tmp/t', local_keep=3)
  assert (o.tier_dir, o.tier_keep, o.local_dir, o.local_keep) == ('/tmp/t', 3, '/tmp/t', 3)
  with pytest.warns(DeprecationWarning, match=r"Options.transport='local' is now 'in_process'"):
    assert options_lib.Options(transport='local').transport == 'in_process'
  with pytest.raises(TypeError, match=r'local_scope= is the former name of tier_scope='):
    options_lib.Options(local_scope='held', tier_scope='held')
  env = {'ORBAX_PATHWAYS_LOCAL_DIR': '/tmp/old', 'ORBAX_PATHWAYS_LOCAL_MAX_BYTES': '7'}
  o = options_lib.Options.from_env(env)
  assert (o.tier_dir, o.tier_max_bytes) == ('/tmp/old', 7)
  assert options_lib.Options.from_env({**env, 'ORBAX_PATHWAYS_TIER_DIR': '/tmp/new'}).tier_dir \
      == '/tmp/new'
  assert options_lib.unknown_env(env) == {}
  monkeypatch.setenv('ORBAX_PATHWAYS_LOCAL_KEEP', '2')
  monkeypatch.setattr(orbax_pathways._install, '_warned_env', set())
  with pytest.warns(DeprecationWarning, match=r'ORBAX_PATHWAYS_LOCAL_KEEP is now '
                                              r'ORBAX_PATHWAYS_TIER_KEEP; ORBAX_PATHWAYS_LOCAL_KEEP '
                                              r'is read for ORBAX_PATHWAYS_TIER_KEEP'):
    orbax_pathways._install._check_env()

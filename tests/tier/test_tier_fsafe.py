"""tier/fsafe.py: the tier's file system rules, on real files (FIFOs, symlinks, other owners)."""

import os
import stat
import threading

import pytest

from orbax_pathways.tier import fsafe


def _mode(path):
  return stat.S_IMODE(os.lstat(path).st_mode)


def test_new_root_is_private(tmp_path):
  root = str(tmp_path / 'a' / 'tier')
  assert fsafe.private_root(root) == ''
  assert _mode(root) == 0o700
  sub = fsafe.private_dirs(root, 'k', 's', 'i')
  assert sub == os.path.join(root, 'k', 's', 'i')
  for p in (os.path.join(root, 'k'), os.path.join(root, 'k', 's'), sub):
    assert _mode(p) == 0o700
  fsafe.write_file(os.path.join(sub, 'f.bin'), b'abc')
  assert _mode(os.path.join(sub, 'f.bin')) == 0o600


def test_root_readable_by_others_is_tightened(tmp_path):
  root = str(tmp_path / 'tier')
  os.mkdir(root)
  os.chmod(root, 0o755)
  assert fsafe.private_root(root) == ''
  assert _mode(root) == 0o700


@pytest.mark.parametrize('mode', [0o777, 0o770, 0o1777])
def test_root_writable_by_others_is_refused(tmp_path, mode):
  root = str(tmp_path / 'tier')
  os.mkdir(root)
  os.chmod(root, mode)
  why = fsafe.private_root(root)
  assert root in why and 'other users can write into it' in why
  assert _mode(root) == mode  # left as found


def test_root_symlink_is_refused(tmp_path):
  target = tmp_path / 'victim'
  target.mkdir(mode=0o700)
  root = str(tmp_path / 'tier')
  os.symlink(target, root)
  why = fsafe.private_root(root)
  assert 'a symlink' in why and 'not a directory' in why


@pytest.mark.skipif(os.geteuid() != 0, reason='needs root to make a directory owned by another uid')
def test_root_of_another_user_is_refused(tmp_path):
  root = str(tmp_path / 'tier')
  os.mkdir(root, 0o700)
  os.chown(root, 65534, 65534)
  why = fsafe.private_root(root)
  assert 'not owned by this user' in why and 'uid 65534' in why


def test_private_dirs_refuse_a_symlinked_component(tmp_path):
  root = str(tmp_path / 'tier')
  assert fsafe.private_root(root) == ''
  elsewhere = tmp_path / 'elsewhere'
  elsewhere.mkdir()
  os.symlink(elsewhere, os.path.join(root, 'k'))
  with pytest.raises(fsafe.UnsafeError, match='a symlink'):
    fsafe.private_dirs(root, 'k', 's')
  assert not (elsewhere / 's').exists()


def test_open_regular_refuses_fifo_without_blocking(tmp_path):
  fifo = str(tmp_path / 'c.bin')
  os.mkfifo(fifo)
  done = []

  def attempt():
    try:
      fsafe.open_regular(fifo, 4)
    except fsafe.UnsafeError as e:
      done.append(str(e))

  t = threading.Thread(target=attempt, daemon=True)
  t.start()
  t.join(5)
  assert done and 'a FIFO' in done[0], 'opening a FIFO blocked or was accepted'


def test_open_regular_refuses_symlinks_and_devices(tmp_path):
  link = str(tmp_path / 'c.bin')
  os.symlink('/dev/zero', link)
  with pytest.raises(fsafe.UnsafeError, match='symlink'):
    fsafe.open_regular(link, 16)
  with pytest.raises(fsafe.UnsafeError, match='a device'):
    fsafe.open_regular('/dev/zero', 16)


def test_open_regular_checks_the_recorded_size(tmp_path):
  p = str(tmp_path / 'c.bin')
  fsafe.write_file(p, b'12345678')
  with fsafe.open_regular(p, 8) as f:
    assert f.read() == b'12345678'
  with pytest.raises(fsafe.UnsafeError, match='holds 8 bytes; its record says 16'):
    fsafe.open_regular(p, 16)


def test_write_file_never_writes_through_a_symlink(tmp_path):
  victim = tmp_path / 'victim.txt'
  victim.write_bytes(b'private')
  link = str(tmp_path / 'manifest.msgpack')
  os.symlink(victim, link)
  with pytest.raises(fsafe.UnsafeError, match='symlink'):
    fsafe.write_file(link, b'x')
  assert victim.read_bytes() == b'private'
  with pytest.raises(FileExistsError):
    fsafe.write_file(str(victim), b'x', exclusive=True)


def test_remove_tree_unlinks_links_not_their_targets(tmp_path):
  victim = tmp_path / 'victim'
  victim.mkdir()
  (victim / 'keep.txt').write_bytes(b'private')
  entry = tmp_path / 'entry'
  entry.mkdir()
  os.symlink(victim, entry / 'link')
  os.symlink(victim, tmp_path / 'toplink')
  fsafe.remove_tree(str(tmp_path / 'toplink'))
  fsafe.remove_tree(str(entry))
  assert not entry.exists() and not os.path.lexists(tmp_path / 'toplink')
  assert (victim / 'keep.txt').read_bytes() == b'private'


def test_listings_do_not_follow_symlinks(tmp_path):
  (tmp_path / 'real').mkdir()
  os.symlink(tmp_path / 'real', tmp_path / 'link')
  (tmp_path / 'file').write_bytes(b'')
  assert fsafe.subdirs(str(tmp_path)) == ['real']
  assert fsafe.subdirs(str(tmp_path / 'link')) == []
  assert not fsafe.is_dir(str(tmp_path / 'link'))
  assert sorted(p for p, _ in fsafe.walk_files(str(tmp_path))) == [
      str(tmp_path / 'file'), str(tmp_path / 'link')]


def test_read_small_bounds_the_size(tmp_path):
  p = str(tmp_path / 'manifest.msgpack')
  fsafe.write_file(p, b'x' * 100)
  assert fsafe.read_small(p, 100) == b'x' * 100
  with pytest.raises(fsafe.UnsafeError, match='more than the 99'):
    fsafe.read_small(p, 99)


def test_root_problem_inspects_without_changing(tmp_path):
  root = str(tmp_path / 'tier')
  assert 'cannot inspect' in fsafe.root_problem(root) and not os.path.exists(root)
  os.mkdir(root, 0o755)
  os.chmod(root, 0o755)
  assert fsafe.root_problem(root) == '' and _mode(root) == 0o755  # readable: read, left alone
  os.chmod(root, 0o777)
  assert 'other users can write into it' in fsafe.root_problem(root)
  assert _mode(root) == 0o777


# ---- another local user (a private mount namespace, a second uid) -------------------------------

ATTACKER_UID = 4343

def test_another_users_tier_directory_is_refused_and_nothing_of_the_victim_is_touched(tmp_path):
  """A takeover by another user: another uid pre-creates the default-named tier
  directory (777) with a symlink into the victim's private folder and a planted entry whose
  chunk links to the victim's 0600 file. The victim's saves warn once and go on without the
  tier; its restore reads storage; nothing in the victim's folder is deleted or created;
  ``orbax-pathways tier`` refuses the directory."""
  from support import private_shm  # pylint: disable=g-import-not-at-top
  from support.workers import tier_attack_worker  # pylint: disable=g-import-not-at-top
  from orbax_pathways.tier import manifest as manifest_lib  # pylint: disable=g-import-not-at-top
  private_shm.skip_unless_possible()
  ckpt = str(tmp_path / 'ckpt')
  private = tmp_path / 'home' / 'private'
  (private / 'docs' / '2024' / 'notes').mkdir(parents=True, mode=0o700)
  (private / 'docs' / '2024' / 'notes' / 'todo.txt').write_text('keep me')
  secret = str(private / 'keys' / 'id_secret')
  save_id = '0123456789abcdef'
  manifest = manifest_lib.encode(manifest_lib.Manifest(
      root=ckpt, step_name='1', item='default', writer='p0', save_id=save_id,
      arrays=(manifest_lib.TierArray('w', 'float32', (8, 1024), (1, 1024), ((0, 0),), (0,),
                               (4096,), ('0.0.bin',)),)))
  tier = f'/dev/shm/orbax-pathways-{os.geteuid()}'
  r = private_shm.run(tier_attack_worker, {
      'tier': tier, 'private': str(private), 'secret': secret, 'uid': ATTACKER_UID,
      'ckpt': ckpt, 'key': manifest_lib.root_key(ckpt), 'save_id': save_id, 'manifest': manifest.hex(),
      'link_key': 'home_private-0123456789abcdef', 'gs_item': 'gs://bucket/run/1/default'})
  assert r['default'] is False  # the default tier for gs:// storage: refused
  assert r['exact'] and r['sources'] == {'storage': 8 * 1024 * 4}
  assert r['listed'] == 0 and r['cli'] == 2
  assert r['after'] == r['planted'], 'the victim wrote into or removed from the attacker\'s tier'
  assert r['secret_ok'] and r['victim_files'] == [
      'docs', 'docs/2024', 'docs/2024/notes', 'docs/2024/notes/todo.txt', 'keys',
      'keys/id_secret']
  skipped = [w for w in r['warnings'] if 'node-local tier skipped' in w]
  assert len(skipped) == 1, r['warnings']  # one warning for the default's and the saves' checks
  assert tier in skipped[0] and 'not owned by this user' in skipped[0]
  assert f'uid {ATTACKER_UID}' in skipped[0]
  not_read = [w for w in r['warnings'] if f'node-local tier {tier} not read' in w]
  assert len(not_read) == 1, r['warnings']  # the listing a restore would make
  assert len(r['warnings']) == 2, r['warnings']


def test_a_chunk_that_is_a_symlink_fifo_or_device_is_never_read(tmp_path, caplog):
  """In a tier this user owns, chunk files replaced by a symlink to a private 0600 file of the
  chunk's size, a FIFO and a symlink to /dev/zero: the restore neither reads nor blocks on
  them (the entry is refused like a damaged copy, storage serves, values exact), and
  ``orbax-pathways tier`` reports the entry damaged without blocking either."""
  import json  # pylint: disable=g-import-not-at-top
  import logging  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  import orbax_pathways  # pylint: disable=g-import-not-at-top
  from orbax_pathways import stats  # pylint: disable=g-import-not-at-top
  from orbax_pathways.cli import main as cli  # pylint: disable=g-import-not-at-top
  from orbax_pathways.tier import config as tier_config  # pylint: disable=g-import-not-at-top
  from orbax_pathways.tier import store  # pylint: disable=g-import-not-at-top

  tier, root = tmp_path / 'tier', tmp_path / 'ckpt'
  orbax_pathways.install(orbax_pathways.Options(tier_dir=str(tier), coalesce_bytes=0))
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ('x', 'y'))
  w = np.arange(256 * 64, dtype=np.float32).reshape(256, 64)
  state = {'w': jax.device_put(w, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(
      'x', 'y')))}
  with ocp.CheckpointManager(root) as m:
    m.save(1, args=ocp.args.StandardSave(state))
    m.wait_until_finished()
  store.flush()
  (e,) = store.entries(str(tier), str(root))
  a = e.manifest.arrays[0]
  assert len(a.files) >= 3, a
  secret = tmp_path / 'secret'
  secret.write_bytes(b's' * a.nbytes[0])  # what the manifest records for the chunk it replaces
  os.chmod(secret, 0o600)
  chunk = [os.path.join(e.path, f) for f in a.files]
  for p in chunk[:3]:
    os.remove(p)
  os.symlink(secret, chunk[0])
  os.mkfifo(chunk[1])
  os.symlink('/dev/zero', chunk[2])
  caplog.set_level(logging.INFO, logger='orbax_pathways')

  done = {}

  def restore():
    with ocp.CheckpointManager(root) as m:
      done['out'] = m.restore(1, args=ocp.args.StandardRestore(state))
    done['cli'] = cli.main(['tier', str(tier), '--json'])

  t = threading.Thread(target=restore, daemon=True)
  t.start()
  t.join(120)
  if t.is_alive():  # a reader blocked on the FIFO: let it go, then fail
    fd = os.open(chunk[1], os.O_WRONLY | os.O_NONBLOCK)
    os.close(fd)
    t.join(30)
    pytest.fail('the restore or `orbax-pathways tier` blocked on a FIFO in place of a chunk')
  np.testing.assert_array_equal(np.asarray(done['out']['w']), w)
  assert stats.last_restore().bytes_by_source.get('local', 0) == 0
  lines = [r.getMessage() for r in caplog.records if 'node-local copy' in r.getMessage()]
  assert len(lines) == 1 and 'not a regular file' in lines[0], lines
  assert done['cli'] == 1
  assert secret.read_bytes() == b's' * a.nbytes[0]


def test_symlinks_inside_the_tier_are_never_followed(tmp_path, caplog):
  """Inside this user's own tier: a root key that is a symlink to a private folder, and another
  entry-looking symlink. The store writes no copy through the link (one warning), lists
  nothing through either, and the clean-up never removes anything they point to."""
  import logging  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top
  import uuid  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from orbax_pathways.transports import values  # pylint: disable=g-import-not-at-top
  from orbax_pathways.plan import boxes  # pylint: disable=g-import-not-at-top
  from orbax_pathways.plan import save as save_plan  # pylint: disable=g-import-not-at-top
  from orbax_pathways.storage import writer as writer_lib  # pylint: disable=g-import-not-at-top
  from orbax_pathways.tier import gc  # pylint: disable=g-import-not-at-top
  from orbax_pathways.tier import manifest as manifest_lib  # pylint: disable=g-import-not-at-top
  from orbax_pathways.tier import config as tier_config  # pylint: disable=g-import-not-at-top
  from orbax_pathways.tier import store  # pylint: disable=g-import-not-at-top

  tier, ckpt, private = tmp_path / 'tier', tmp_path / 'ckpt', tmp_path / 'private'
  (private / '1' / 'default' / 'p0.x').mkdir(parents=True)
  (private / '1' / 'default' / 'p0.x' / 'notes.txt').write_text('keep me')
  hour_ago = time.time() - 3600
  for d, dirs, files in os.walk(private):
    for n in dirs + files:
      os.utime(os.path.join(d, n), (hour_ago, hour_ago))
  assert fsafe.private_root(str(tier)) == ''
  os.symlink(private, tier / manifest_lib.root_key(str(ckpt)))  # this directory's own root key
  os.symlink(private, tier / 'other-0123456789abcdef')
  (ckpt / '1').mkdir(parents=True)
  cfg = tier_config.resolve(str(tier))
  leaf = values.SaveLeaf('w', (16,), np.dtype(np.uint8), np.dtype(np.uint8), False, 1 << 20)
  plan = save_plan.ArrayWritePlan((16,), (16,), ())
  piece = writer_lib.Piece(boxes.Box((0,), (16,)), np.arange(16, dtype=np.uint8))
  caplog.set_level(logging.INFO, logger='orbax_pathways')
  assert store.write_entry(cfg, f'{ckpt}/1/default', 'p0', uuid.uuid4().hex[:16], [leaf],
                           [plan], [[piece]], {}) is None
  warnings = [r.getMessage() for r in caplog.records if 'node-local tier skipped' in r.getMessage()]
  assert len(warnings) == 1 and 'a symlink' in warnings[0], warnings
  assert store.entries(str(tier)) == []
  gc.collect(str(tier), max_age_s=0, max_bytes=0)
  assert (private / '1' / 'default' / 'p0.x' / 'notes.txt').read_text() == 'keep me'
  assert sorted(os.listdir(private)) == ['1']


@pytest.mark.parametrize('files,problem', [
    (('../../../../secret',), "'../../../../secret' is not a chunk file name"),
    (('/etc/passwd',), "'/etc/passwd' is not a chunk file name"),
    (('0.0.bin', '0.0.bin'), 'a chunk file is named twice'),
])
def test_a_manifest_naming_other_files_is_damaged(tmp_path, files, problem):
  """A manifest may name only the chunk files of its own entry: one naming a path out of it
  (or a file twice) makes the entry damaged, so no reader ever opens that path."""
  from orbax_pathways.tier import manifest as manifest_lib  # pylint: disable=g-import-not-at-top
  from orbax_pathways.tier import config as tier_config  # pylint: disable=g-import-not-at-top
  from orbax_pathways.tier import store  # pylint: disable=g-import-not-at-top
  tier = tmp_path / 'tier'
  assert fsafe.private_root(str(tier)) == ''
  entry = fsafe.private_dirs(str(tier), 'ckpt-0123456789abcdef', '1', 'default', 'p0.abc')
  n = len(files)
  m = manifest_lib.Manifest(root=str(tmp_path / 'ckpt'), step_name='1', item='default', writer='p0',
                      save_id='abc', arrays=(manifest_lib.TierArray(
                          'w', 'uint8', (4 * n,), (4,), tuple((4 * i,) for i in range(n)),
                          (0,) * n, (4,) * n, files),))
  fsafe.write_file(os.path.join(entry, manifest_lib.MANIFEST), manifest_lib.encode(m))
  (e,) = store.entries(str(tier))
  assert e.manifest is None and problem in e.error, e.error

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

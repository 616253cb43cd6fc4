"""Another local user's takeover of the default tier directory, in a private mount namespace
with its own /dev/shm (``support.private_shm.run``, as root), for ``tests/tier/test_tier_fsafe.py``
(``test_another_users_tier_directory_is_refused_and_nothing_of_the_victim_is_touched``).

    python -m support.workers.tier_attack_worker PARAMS_JSON

The attacker (a forked child that becomes ``uid``, before anything else is imported) makes the
victim's default tier directory ``tier`` first, world-writable, with a symlink into the
victim's ``private`` folder and a planted entry whose chunk is a symlink to the victim's 0600
file ``secret``. The victim (this process) then resolves the default tier for a gs:// item
(``gs_item``), saves steps 1 and 2 into ``ckpt`` with that directory as its tier, restores step
2, lists the tier and runs ``orbax-pathways tier`` on it. Prints after ``RESULT `` whether the
default was taken, the restore's exactness and bytes by source, the entries listed, the CLI's
exit code, the tier's tree before and after, the victim's files, whether the secret is intact
and every warning.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback


def _attack(p) -> list[str]:
  """The attacker's set-up (a forked child as ``p['uid']``); returns what it planted."""
  tier, private, secret = p['tier'], p['private'], p['secret']
  os.makedirs(os.path.dirname(secret), mode=0o700)
  with open(secret, 'wb') as f:
    f.write(b'victim secret ' * 300)
  os.chmod(secret, 0o600)
  hour_ago = time.time() - 3600  # the victim's files, untouched for an hour (idle for clean-up)
  for d, dirs, files in os.walk(private, topdown=False):
    for n in dirs + files:
      os.utime(os.path.join(d, n), (hour_ago, hour_ago))
  os.utime(private, (hour_ago, hour_ago))
  pid = os.fork()
  if pid == 0:  # the attacker
    try:
      os.setgroups([])
      os.setgid(p['uid'])
      os.setuid(p['uid'])
      os.mkdir(tier)
      os.chmod(tier, 0o777)
      os.symlink(private, os.path.join(tier, p['link_key']))
      entry = os.path.join(tier, p['key'], '1', 'default', 'p0.' + p['save_id'])
      os.makedirs(entry)
      for d in (os.path.join(tier, p['key']), os.path.join(tier, p['key'], '1'),
                os.path.join(tier, p['key'], '1', 'default'), entry):
        os.chmod(d, 0o777)
      with open(os.path.join(entry, 'manifest.msgpack'), 'wb') as f:
        f.write(bytes.fromhex(p['manifest']))
      os.symlink(secret, os.path.join(entry, '0.0.bin'))
      os._exit(0)  # pylint: disable=protected-access
    except BaseException:  # pylint: disable=broad-except
      traceback.print_exc()
      os._exit(1)  # pylint: disable=protected-access
  assert os.waitpid(pid, 0)[1] == 0, 'the attacker could not set up'
  return sorted(os.path.relpath(os.path.join(d, n), tier)
                for d, dirs, files in os.walk(tier) for n in dirs + files)


def main() -> None:
  p = json.loads(sys.argv[1])
  tier, private, secret = p['tier'], p['private'], p['secret']
  planted = _attack(p)

  import logging  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  import orbax_pathways  # pylint: disable=g-import-not-at-top
  from orbax_pathways import engine, stats  # pylint: disable=g-import-not-at-top
  from orbax_pathways.cli import main as cli  # pylint: disable=g-import-not-at-top
  from orbax_pathways.tier import store  # pylint: disable=g-import-not-at-top

  records = []
  handler = logging.Handler()
  handler.emit = records.append
  logging.getLogger('orbax_pathways').addHandler(handler)
  logging.getLogger('orbax_pathways').setLevel(logging.INFO)

  # The default tier (gs:// storage: the default applies) resolves to the attacker's directory:
  # refused, nothing created.
  os.environ.pop('ORBAX_PATHWAYS_TIER_DIR', None)
  default = engine.Engine(orbax_pathways.Options()).tier(p['gs_item'])

  # A real save and restore with that directory as the node's tier.
  os.environ['ORBAX_PATHWAYS_TIER_DIR'] = tier
  orbax_pathways.install(orbax_pathways.Options.from_env())
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ('x',))
  w = np.arange(8 * 1024, dtype=np.float32).reshape(8, 1024)
  state = {'w': jax.device_put(w, jax.sharding.NamedSharding(mesh,
                                                             jax.sharding.PartitionSpec('x')))}
  with ocp.CheckpointManager(p['ckpt']) as m:
    m.save(1, args=ocp.args.StandardSave(state))
    m.save(2, args=ocp.args.StandardSave(state))
    m.wait_until_finished()
    store.flush()
    out = m.restore(2, args=ocp.args.StandardRestore(state))
  exact = bool(np.array_equal(np.asarray(out['w']), w))
  sources = stats.last_restore().bytes_by_source
  listed = store.entries(tier)
  cli_code = cli.main(['tier', tier])
  after = sorted(os.path.relpath(os.path.join(d, n), tier)
                 for d, dirs, files in os.walk(tier) for n in dirs + files)
  victim_files = sorted(os.path.relpath(os.path.join(d, n), private)
                        for d, dirs, files in os.walk(private) for n in dirs + files)
  with open(secret, 'rb') as f:
    secret_ok = f.read() == b'victim secret ' * 300
  warnings = [r.getMessage() for r in records if r.levelno >= logging.WARNING]
  print('RESULT ' + json.dumps({
      'default': default is not None, 'exact': exact, 'sources': sources, 'listed': len(listed),
      'cli': cli_code, 'planted': planted, 'after': after, 'victim_files': victim_files,
      'secret_ok': secret_ok, 'warnings': warnings}))


if __name__ == '__main__':
  main()

import time, threading, traceback, jax, numpy as np, orbax.checkpoint as ocp, pytest, logging
import orbax_pathways
from helpers import mesh, random_state

@pytest.mark.parametrize('only_ts', [True, False])
def test_y(faulty_gcs, only_ts):
  m = mesh()
  state = random_state(m)
  path = faulty_gcs.path('ckpt')
  mngr = ocp.CheckpointManager(path)
  mngr.save(1, args=ocp.args.StandardSave(state)); mngr.wait_until_finished()
  orbax_pathways.install(orbax_pathways.Options(storage_retries=1))
  faulty_gcs.proxy.reset_stats()
  seen = []
  orig = faulty_gcs.proxy._choose
  def choose(method, target):
    seen.append((method, target)); return orig(method, target)
  faulty_gcs.proxy._choose = choose
  if only_ts:
    faulty_gcs.proxy.match = lambda m, t: 'uploadType=media' in t
  faulty_gcs.proxy.set_rate(1.0, kinds=("503",))
  res = {}
  def run():
    t = time.monotonic()
    try:
      try:
        r = mngr.save(2, args=ocp.args.StandardSave(state))
        res['save_ret'] = r
        res['save_s'] = time.monotonic() - t
      except BaseException as e:
        res['where'] = 'save'; res['err'] = e; res['tb'] = traceback.format_exc(); return
      mngr.wait_until_finished()
      res['where'] = 'none'
    except BaseException as e:
      res['where'] = 'wait'; res['err'] = e; res['tb'] = traceback.format_exc()
    finally:
      res['t'] = time.monotonic() - t
  th = threading.Thread(target=run, daemon=True); th.start()
  th.join(60)
  print({k: v for k, v in res.items() if k != 'tb'})
  print(res.get('tb', '')[-6000:])
  print(faulty_gcs.proxy.stats())
  for s in seen[:40]: print(s)
  faulty_gcs.proxy.set_rate(0)
  t = time.monotonic()
  try: mngr.close()
  except BaseException as e: print('close raised', repr(e)[:500])
  print('close', time.monotonic() - t)
  print(faulty_gcs.objects())

import time, threading, jax, numpy as np, orbax.checkpoint as ocp, pytest, logging
import orbax_pathways
from helpers import mesh, random_state

def test_y(faulty_gcs):
  m = mesh()
  state = random_state(m)
  path = faulty_gcs.path('ckpt')
  mngr = ocp.CheckpointManager(path)
  mngr.save(1, args=ocp.args.StandardSave(state)); mngr.wait_until_finished()
  orbax_pathways.install(orbax_pathways.Options(storage_retries=1))
  faulty_gcs.proxy.reset_stats()
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
        res['where'] = 'save'; res['err'] = e; return
      mngr.wait_until_finished()
      res['where'] = 'none'
    except BaseException as e:
      res['where'] = 'wait'; res['err'] = e
    finally:
      res['t'] = time.monotonic() - t
  th = threading.Thread(target=run, daemon=True); th.start()
  for i in range(24):
    th.join(5)
    print(i*5, faulty_gcs.proxy.stats()['requests'], flush=True)
    if not th.is_alive(): break
  print(res)
  print(repr(res.get('err'))[:3000])
  print(faulty_gcs.proxy.stats())

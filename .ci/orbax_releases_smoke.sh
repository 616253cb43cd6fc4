#!/usr/bin/env bash
# A fast smoke of every orbax-checkpoint release between the two that .ci/run tests in full
# (.ci/constraints-oldest.txt and -newest.txt pin them) that the package index serves: each is
# installed over the given venv's Orbax (--no-deps, nothing else changes) and runs the seam's
# conformance test (every Orbax attribute the package patches is there), stock-format interop
# both ways, a v1 save and load, and the emergency drop-in's persistent steps read by stock
# Orbax. A release the index does not serve is skipped, said in one line. Usage:
#   .ci/orbax_releases_smoke.sh VENV     (.ci/run passes .venv after the oldest half's suite)
# Exit status: non-zero if any served release failed. About 15-20 s per release on 2 cores.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=$1
pin() { sed -n 's/^orbax-checkpoint==\([0-9.]*\).*/\1/p' ".ci/constraints-$1.txt"; }
OLDEST=$(pin oldest); NEWEST=$(pin newest)
major_minor=${OLDEST%.*}
if [ "$major_minor" != "${NEWEST%.*}" ]; then
  echo "smoke: $OLDEST and $NEWEST differ beyond the patch number" >&2
  exit 2
fi
TESTS=(tests/compat/test_seam.py::test_every_declared_target_is_in_the_installed_orbax
       tests/frontends/test_format_compat.py
       tests/frontends/test_orbax_v1.py::test_save_and_load_go_through_our_engine
       tests/manager/test_emergency_dropin.py::test_stock_orbax_reads_the_persistent_steps)
status=0
for ((p = ${OLDEST##*.} + 1; p < ${NEWEST##*.}; p++)); do
  v="$major_minor.$p"
  if ! "$VENV/bin/python" -m pip install -q --no-deps "orbax-checkpoint==$v" >/dev/null 2>&1; then
    echo "== orbax-checkpoint $v: not served by the package index; skipped"
    continue
  fi
  echo "== orbax-checkpoint $v: smoke"
  "$VENV/bin/python" -m pytest -q -n 0 "${TESTS[@]}" || status=1
done
# The venv as it was: the oldest pin again.
"$VENV/bin/python" -m pip install -q --no-deps "orbax-checkpoint==$OLDEST" >/dev/null 2>&1 \
  || { echo "smoke: could not put orbax-checkpoint $OLDEST back into $VENV" >&2; status=1; }
exit $status

#!/usr/bin/env bash
# The compatibility matrix: the tests .ci/run runs on each older supported Celery minor.
#   scripts/compat_matrix.sh minors      the minors, one per line
#   scripts/compat_matrix.sh venv 5.5    make (or reuse) .venv-celery5.5 with Celery 5.5.x
#   scripts/compat_matrix.sh test 5.5    run the matrix's tests in it
# A venv is reused while pyproject.toml is unchanged (its hash is kept beside it).
set -euo pipefail
cd "$(dirname "$0")/.."
MINORS="5.4 5.5 5.6"
# Unit tests, the integration tests of what rides kombu's and redis-py's internals (the audited
# backend's scripts, claims riding kombu's round trips, the claim line, the lease store's
# batches), then the system tests that touch what differs between Celery versions: the canvas
# suite (replace, chain, chord, group, retry, errbacks; failure recording: .get() raises, link_error
# runs once, a chain through a failure fails) and the chord unlock, each beside stock Celery of the
# same version in the same module; kill -9 recovery (stock's stuck task beside it); one beat
# failover.
TESTS=(
  tests/unit
  tests/integration/test_backend_audited.py
  tests/integration/test_worker_riding.py
  tests/integration/test_worker_claim_line.py
  tests/integration/test_lease_batches.py
  tests/system/test_canvas.py
  tests/system/test_chord_unlock.py
  "tests/system/test_worker_recovery.py::test_kill9_mid_task_runs_elsewhere_exactly_once"
  "tests/system/test_worker_recovery.py::test_stock_celery_leaves_a_killed_workers_task_unrun"
  "tests/system/test_beat_ha.py::test_kill9_of_the_leader"
  "tests/system/test_beat_ha.py::test_two_stock_beats_both_dispatch"
)

case "${1:-}" in
  minors)
    printf '%s\n' $MINORS
    ;;
  venv)
    v=$2
    dir=".venv-celery$v"
    stamp=$(sha256sum pyproject.toml | cut -c1-16)
    if [ -x "$dir/bin/python" ] && [ "$(cat "$dir/.stamp" 2>/dev/null)" = "$stamp" ]; then
      exit 0
    fi
    rm -rf "$dir"
    python3 -m venv "$dir"
    "$dir/bin/pip" install -q --upgrade pip
    "$dir/bin/pip" install -q -e '.[test]' "celery==$v.*" "kombu==$v.*"
    echo "$stamp" >"$dir/.stamp"
    ;;
  test)
    v=$2
    dir=".venv-celery$v"
    "$dir/bin/python" -c "import celery, kombu, redis; \
print('celery', celery.__version__, 'kombu', kombu.__version__, 'redis-py', redis.__version__)"
    exec "$dir/bin/python" -m pytest -q -p no:cacheprovider "${TESTS[@]}"
    ;;
  *)
    echo "usage: $0 minors | venv MINOR | test MINOR" >&2
    exit 2
    ;;
esac

#!/usr/bin/env bash
# The main job on the embedded default (SQLite store and broker, no servers): makes .venv and
# installs the package the first time, then runs the demo (extra arguments go to it, e.g.
# --store redis://127.0.0.1:6379/0 --broker redis://127.0.0.1:6379/1, or a RabbitMQ broker:
# --broker amqp://guest:guest@127.0.0.1:5672//). A Redis or PostgreSQL URL there also installs
# the `redis` / `postgres` extra, once (the default run never does); an AMQP broker needs no
# extra (kombu's py-amqp transport comes with celery).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
need="import celery_lease, celery, sqlalchemy"
extras=""
previous=""
for arg in "$@"; do
  url=""
  case "$previous" in --store | --broker) url=$arg ;; esac
  case "$arg" in --store=* | --broker=*) url=${arg#*=} ;; esac
  case "$url" in
    redis* | rediss* | sentinel*)  # kombu's Redis transport needs packaging too (celery[redis])
      need="$need, redis, kombu.transport.redis"
      case ",$extras," in *,redis,*) ;; *) extras="${extras:+$extras,}redis" ;; esac ;;
    amqp* | pyamqp*)  # py-amqp is a dependency of kombu, so of celery: no extra
      need="$need, amqp, kombu.transport.pyamqp" ;;
    *postgres*)
      need="$need, psycopg"
      case ",$extras," in *,postgres,*) ;; *) extras="${extras:+$extras,}postgres" ;; esac ;;
  esac
  previous=$arg
done
if ! .venv/bin/python -c "$need" 2>/dev/null; then
  echo "installing celery_lease${extras:+[$extras]} into .venv (once) ..."
  .venv/bin/python -m pip install -q --disable-pip-version-check -e ".${extras:+[$extras]}"
fi
exec .venv/bin/python -m example_project.run "$@"

#!/usr/bin/env bash
# Installs rabbitmq-server (with the Erlang runtime it needs, which brings epmd) from Debian's
# packages when missing: the RabbitMQ tests start a private node with it (tests/tooling/
# rabbitmq.py, from the scripts in /usr/lib/rabbitmq/bin, not /usr/sbin's wrappers, which are
# not on every user's PATH), never the system service.
set -euo pipefail
bin=${CELERY_LEASE_RABBITMQ_BIN:-/usr/lib/rabbitmq/bin}
present() {
  [ -x "$bin/rabbitmq-server" ] && [ -x "$bin/rabbitmqctl" ] && command -v epmd >/dev/null 2>&1
}
if present; then
  exit 0
fi
if [ "$(id -u)" != "0" ]; then
  echo "rabbitmq-server is missing; install it (apt-get install rabbitmq-server) or run as root" >&2
  exit 1
fi
echo "installing rabbitmq-server with apt-get ..." >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null
apt-get install -y -qq rabbitmq-server >/dev/null
# Where no policy-rc.d forbids it, the package starts a system node on the default ports (5672,
# epmd on 4369); the tests never use it, and their own node avoids those ports and its cookie.
present

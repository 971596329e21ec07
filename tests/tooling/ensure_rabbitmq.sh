#!/usr/bin/env bash
# Installs rabbitmq-server (with the Erlang runtime it needs, which brings epmd) from Debian's
# packages when missing: the RabbitMQ broker tests start their own private node with it
# (tests/tooling/servers.py, RabbitMQServer), never the system service.
set -euo pipefail
if command -v rabbitmq-server >/dev/null 2>&1 && command -v rabbitmqctl >/dev/null 2>&1; then
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
# The package may start a system service on the default ports (5672, epmd on 4369) where no
# policy-rc.d forbids it; the tests never use it, and their own node avoids those ports.
command -v rabbitmq-server >/dev/null
command -v rabbitmqctl >/dev/null

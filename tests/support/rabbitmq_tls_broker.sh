#!/usr/bin/env bash
# A throwaway rabbitmq-server with a TLS listener, and the certificates to test it with: the
# fixture of tests/rabbitmq/rabbitmq_tls_test.cpp.
#
#   rabbitmq_tls_broker.sh start STATE_DIR   # certificates -> STATE_DIR/certs, the node ->
#                                            # STATE_DIR/port (AMQP) and STATE_DIR/tls_port (AMQPS)
#   rabbitmq_tls_broker.sh stop STATE_DIR    # stops the node, removes it and the certificates
#
# The certificates (openssl CLI, EC P-256 keys, valid 2 days) in STATE_DIR/certs:
#   ca.pem/.key              the test CA; the node trusts it for client certificates
#   server.pem/.key          the node's certificate: CN 127.0.0.1, SAN DNS:127.0.0.1, DNS:localhost,
#                            IP:127.0.0.1 (rabbitmq-c matches DNS names only)
#   client.pem/.key          a client certificate of the test CA (mutual TLS)
#   wrong-host.pem/.key      of the test CA, for wrong.example only (a hostname mismatch)
#   other-ca.pem/.key        an unrelated CA (a verification failure)
# The node is tests/support/rabbitmq_broker.sh's (free loopback ports, its own temp dir, stopped
# by PID), started with IDEM_RABBITMQ_TLS_DIR. A node that cannot start is an error (exit 1).
set -uo pipefail

cmd=${1:?usage: rabbitmq_tls_broker.sh start|stop STATE_DIR}
state=${2:?usage: rabbitmq_tls_broker.sh start|stop STATE_DIR}
here=$(cd "$(dirname "$0")" && pwd)
command -v openssl >/dev/null || { echo "rabbitmq_tls_broker.sh: openssl not found (apt-get install openssl)" >&2; exit 1; }

make_certs() {  # make_certs DIR
  local d=$1
  mkdir -p "$d" || return 1
  key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$d/$1.key" 2>/dev/null; }
  ca() {  # ca NAME CN
    key "$1" && openssl req -x509 -new -key "$d/$1.key" -subj "/CN=$2" -days 2 -out "$d/$1.pem" \
      -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
  }
  leaf() {  # leaf NAME CN EXTENSIONS: signed by the test CA
    key "$1" && openssl req -new -key "$d/$1.key" -subj "/CN=$2" -out "$d/$1.csr" 2>/dev/null &&
      openssl x509 -req -in "$d/$1.csr" -CA "$d/ca.pem" -CAkey "$d/ca.key" -CAcreateserial -days 2 \
        -out "$d/$1.pem" -extfile <(printf '%s\n' "basicConstraints=CA:FALSE" "$3") 2>/dev/null &&
      rm -f "$d/$1.csr"
  }
  ca ca "idem test CA" && ca other-ca "idem unrelated CA" &&
    leaf server 127.0.0.1 "subjectAltName=DNS:127.0.0.1,DNS:localhost,IP:127.0.0.1
extendedKeyUsage=serverAuth" &&
    leaf wrong-host wrong.example "subjectAltName=DNS:wrong.example
extendedKeyUsage=serverAuth" &&
    leaf client "idem test client" "extendedKeyUsage=clientAuth" &&
    chmod 644 "$d"/*.pem "$d"/*.key
}

case "$cmd" in
start)
  mkdir -p "$state"
  rm -rf "$state/certs"
  make_certs "$state/certs" || { echo "rabbitmq_tls_broker.sh: FAILED: openssl could not make the certificates" >&2; exit 1; }
  IDEM_RABBITMQ_TLS_DIR="$state/certs" "$here/rabbitmq_broker.sh" start "$state" || { rm -rf "$state/certs"; exit 1; }
  [[ -s $state/tls_port ]] || { echo "rabbitmq_tls_broker.sh: FAILED: no TLS port" >&2; "$0" stop "$state"; exit 1; }
  ;;
stop)
  rm -rf "$state/certs"
  "$here/rabbitmq_broker.sh" stop "$state"
  ;;
*)
  echo "usage: rabbitmq_tls_broker.sh start|stop STATE_DIR" >&2
  exit 2
  ;;
esac

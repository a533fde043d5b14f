#!/bin/sh
# Makes the throwaway certificates of the TLS tests in DIR with the openssl command:
#   ca.crt/ca.key          the test CA
#   server.crt/.key        signed by it, for localhost and 127.0.0.1 (SAN); clientAuth too: a
#                          Redis Cluster node presents it on the TLS cluster bus
#   client.crt/.key        signed by it, for mutual TLS (clientAuth)
#   expired.crt/.key       signed by it, for localhost and 127.0.0.1, valid in 2020 only
#   wronghost.crt/.key     signed by it, for wrong.example and 10.9.9.9 only
#   other-ca.crt           a CA that signed none of them (the "unknown CA" case)
# RSA 2048 keys: fast to make, and every TLS version takes them.
#   make_certs.sh DIR
set -eu
dir=${1:?usage: make_certs.sh DIR}
mkdir -p "$dir"
cd "$dir"
days=30

key() { openssl genrsa -out "$1.key" 2048 2>/dev/null && chmod 600 "$1.key"; }
ca() { # ca NAME SUBJECT
  key "$1"
  openssl req -x509 -new -key "$1.key" -sha256 -days "$days" -subj "$2" -out "$1.crt" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign"
}
leaf() { # leaf NAME CN SAN EKU
  key "$1"
  openssl req -new -key "$1.key" -subj "/CN=$2" -out "$1.csr"
  printf 'subjectAltName=%s\nextendedKeyUsage=%s\nbasicConstraints=CA:FALSE\n' "$3" "$4" >"$1.ext"
  openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -sha256 -days "$days" \
    -extfile "$1.ext" -out "$1.crt" 2>/dev/null
  rm -f "$1.csr" "$1.ext"
}

ca ca "/CN=idem test CA"
ca other-ca "/CN=idem other CA"
leaf server localhost "DNS:localhost,IP:127.0.0.1" serverAuth,clientAuth
leaf client idem-app "DNS:idem-app" clientAuth
leaf wronghost wrong.example "DNS:wrong.example,IP:10.9.9.9" serverAuth

# The expired one needs explicit dates: `openssl ca` with a throwaway database.
key expired
openssl req -new -key expired.key -subj "/CN=localhost" -out expired.csr
mkdir -p ca-db
: >ca-db/index.txt
cat >ca-db/ca.cnf <<CNF
[ca]
default_ca = test
[test]
database = ca-db/index.txt
new_certs_dir = ca-db
serial = ca-db/serial
default_md = sha256
policy = any
copy_extensions = none
x509_extensions = leaf
[any]
commonName = supplied
[leaf]
subjectAltName = DNS:localhost,IP:127.0.0.1
extendedKeyUsage = serverAuth
basicConstraints = CA:FALSE
CNF
echo 01 >ca-db/serial
openssl ca -batch -config ca-db/ca.cnf -cert ca.crt -keyfile ca.key -in expired.csr -out expired.crt \
  -startdate 20200101000000Z -enddate 20200102000000Z -notext 2>/dev/null
rm -rf ca-db expired.csr
chmod 644 ./*.crt
echo "make_certs: certificates in $dir"

#!/usr/bin/env bash
# Credentials for a TLS SuperLink with SuperNode authentication (fedmech deploy-local, tests).
#
#   scripts/make_certs.sh DIR [NUM_NODES] [HOST ...]
#
# Writes into DIR (created, mode 700): ca.crt/ca.key (a throw-away CA), server.crt/server.key
# (signed by it, SANs localhost, 127.0.0.1, ::1 and every HOST given), and node_I/node_I.pub for
# I in 0..NUM_NODES-1 (ECDSA P-384 key pairs in OpenSSH format, what `flwr supernode register`
# and `flower-supernode --auth-supernode-private-key` read). Keys never belong in git.
set -euo pipefail

if [[ $# -lt 1 ]]; then
  echo "usage: $0 DIR [NUM_NODES] [HOST ...]" >&2
  exit 2
fi
dir=$1
nodes=${2:-2}
shift $(( $# >= 2 ? 2 : 1 ))
if ! [[ $nodes =~ ^[0-9]+$ ]]; then
  echo "NUM_NODES must be a non-negative integer, got '$nodes'" >&2
  exit 2
fi

mkdir -p "$dir"
chmod 700 "$dir"
cd "$dir"

san="DNS:localhost,IP:127.0.0.1,IP:::1"
for host in "$@"; do
  if [[ $host =~ ^[0-9.]+$ || $host == *:* ]]; then san+=",IP:$host"; else san+=",DNS:$host"; fi
done

openssl req -x509 -newkey rsa:2048 -nodes -days 30 -subj "/CN=fedmech test CA" \
  -keyout ca.key -out ca.crt 2>/dev/null
openssl req -newkey rsa:2048 -nodes -subj "/CN=localhost" -keyout server.key -out server.csr 2>/dev/null
printf 'subjectAltName=%s\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n' \
  "$san" > server.ext
openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 30 \
  -extfile server.ext -out server.crt 2>/dev/null
rm -f server.csr server.ext ca.srl

for ((i = 0; i < nodes; i++)); do
  rm -f "node_$i" "node_$i.pub"
  ssh-keygen -q -t ecdsa -b 384 -N "" -C "fedmech-node-$i" -f "node_$i"
done
chmod 600 ca.key server.key
echo "wrote CA, server certificate ($san) and $nodes node key pair(s) to $(pwd)"

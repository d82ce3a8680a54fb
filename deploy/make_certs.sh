#!/usr/bin/env bash
# Self-signed TLS certificates for a local (or lab) SuperLink -- NOT for production.
#
#   deploy/make_certs.sh [OUT_DIR] [EXTRA_HOST ...]
#
# Writes OUT_DIR (default deploy/certs):
#   ca.crt / ca.key          a throw-away certificate authority (give ca.crt to every SuperNode
#                            and to the `flwr` CLI as root certificate; keep ca.key private)
#   server.pem / server.key  the SuperLink's certificate, valid for localhost, 127.0.0.1, ::1
#                            and every EXTRA_HOST (IP address or DNS name of the SuperLink
#                            machine when SuperNodes run elsewhere)
# Existing files are replaced. Needs openssl >= 1.1.1.
set -euo pipefail

out="${1:-$(dirname "$0")/certs}"
shift || true
days="${CERT_DAYS:-365}"
mkdir -p "$out"
umask 077

san="DNS:localhost,IP:127.0.0.1,IP:::1"
for host in "$@"; do
    if [[ "$host" =~ ^[0-9.]+$ || "$host" == *:* ]]; then san="$san,IP:$host"; else san="$san,DNS:$host"; fi
done

# Certificate authority
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -sha256 -nodes -days "$days" \
    -keyout "$out/ca.key" -out "$out/ca.crt" \
    -subj "/CN=fcl-flower local CA" \
    -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null

# Server key + certificate signing request, then sign it with the CA
openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -sha256 -nodes \
    -keyout "$out/server.key" -out "$out/server.csr" \
    -subj "/CN=fcl-flower SuperLink" 2>/dev/null
ext="$(mktemp)"
trap 'rm -f "$ext"' EXIT
cat > "$ext" <<EXT
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature
extendedKeyUsage=serverAuth
subjectAltName=$san
EXT
openssl x509 -req -sha256 -days "$days" -in "$out/server.csr" \
    -CA "$out/ca.crt" -CAkey "$out/ca.key" -CAcreateserial \
    -out "$out/server.pem" -extfile "$ext" 2>/dev/null
rm -f "$out/server.csr" "$out/ca.srl"
chmod 644 "$out/ca.crt" "$out/server.pem"

openssl verify -CAfile "$out/ca.crt" "$out/server.pem" >/dev/null
echo "TLS certificates in $out: server.pem valid for $san; CA certificate: $out/ca.crt"

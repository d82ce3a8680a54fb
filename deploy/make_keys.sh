#!/usr/bin/env bash
# SuperNode authentication keys (ECDSA P-384, OpenSSH format, as Flower 1.41 expects).
#
#   deploy/make_keys.sh [OUT_DIR] [N]
#
# Writes OUT_DIR (default deploy/keys)/supernode-<k>{,.pub} for k = 0..N-1 (default N=3).
# The private key stays on SuperNode k (--auth-supernode-private-key); the public key is
# registered with the SuperLink by its operator (`flwr supernode register <key>.pub <link>`).
# A SuperLink started with --enable-supernode-auth refuses every SuperNode whose key was not
# registered. Existing keys are kept (delete them to rotate).
set -euo pipefail

out="${1:-$(dirname "$0")/keys}"
count="${2:-3}"
mkdir -p "$out"
umask 077
for ((k = 0; k < count; k++)); do
    key="$out/supernode-$k"
    [[ -f "$key" ]] && continue
    if command -v ssh-keygen >/dev/null; then
        ssh-keygen -q -t ecdsa -b 384 -N "" -C "fcl-flower supernode-$k" -f "$key"
    else  # the cryptography package ships with flwr
        python3 - "$key" <<'PY'
import sys
from cryptography.hazmat.primitives import serialization as s
from cryptography.hazmat.primitives.asymmetric import ec
key = ec.generate_private_key(ec.SECP384R1())
path = sys.argv[1]
open(path, "wb").write(key.private_bytes(s.Encoding.PEM, s.PrivateFormat.OpenSSH, s.NoEncryption()))
open(path + ".pub", "wb").write(key.public_key().public_bytes(s.Encoding.OpenSSH, s.PublicFormat.OpenSSH) + b"\n")
PY
    fi
    chmod 644 "$key.pub"
done
echo "SuperNode keys in $out: $(cd "$out" && ls supernode-*.pub | tr '\n' ' ')"

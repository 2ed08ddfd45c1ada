#!/usr/bin/env bash
# A self-signed certificate for trying HTTPS/WSS (docs/web-client.md, "From another machine"):
#   bash scripts/dev_cert.sh [DIR] [NAME ...]
# writes DIR/cert.pem and DIR/key.pem (default DIR: out/tls; the key is mode 600) for localhost,
# 127.0.0.1, ::1 and each NAME (a host name or an IP address), valid 30 days, then prints the
# http_options lines that serve them. A browser warns about a self-signed certificate once; for
# anything beyond trying it out, use a certificate from your CA (or Let's Encrypt) instead.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-out/tls}
shift || true
san="DNS:localhost,IP:127.0.0.1,IP:::1"
for name in "$@"; do
  if [[ "$name" =~ ^[0-9.]+$ || "$name" == *:* ]]; then san="$san,IP:$name"; else san="$san,DNS:$name"; fi
done
mkdir -p "$dir"
( umask 077; openssl req -x509 -newkey rsa:2048 -nodes -days 30 -subj "/CN=${1:-localhost}" \
    -addext "subjectAltName=$san" -keyout "$dir/key.pem" -out "$dir/cert.pem" 2>/dev/null )
chmod 644 "$dir/cert.pem"
echo "wrote $dir/cert.pem and $dir/key.pem ($san); in serve_config*.yaml:"
echo "http_options:"
echo "  ssl_certfile: $(realpath "$dir/cert.pem")"
echo "  ssl_keyfile: $(realpath "$dir/key.pem")"

#!/usr/bin/env bash
# Writes a throwaway loopback homeserver into DIR (config, signing key) for PORT.
#   configure.sh VENV DIR PORT [relaxed]
# "relaxed" lifts the rate limits for load tests; without it Synapse's defaults apply (429s).
set -euo pipefail
venv="$1"; dir="$2"; port="$3"; mode="${4:-default}"
mkdir -p "$dir/media"
secret="cultnet-test-shared-secret"
cat > "$dir/homeserver.yaml" <<YAML
server_name: localhost
public_baseurl: http://127.0.0.1:$port/
pid_file: $dir/homeserver.pid
listeners:
  - port: $port
    bind_addresses: ['127.0.0.1']
    type: http
    tls: false
    x_forwarded: false
    resources:
      - names: [client]
        compress: false
database:
  name: sqlite3
  args:
    database: $dir/homeserver.db
log_config: $dir/log.yaml
media_store_path: $dir/media
signing_key_path: $dir/signing.key
registration_shared_secret: "$secret"
macaroon_secret_key: "cultnet-test-macaroon"
form_secret: "cultnet-test-form"
report_stats: false
enable_registration: false
federation_domain_whitelist: []
trusted_key_servers: []
suppress_key_server_warning: true
room_list_publication_rules:
  - action: allow
YAML
if [ "$mode" = relaxed ]; then
  fast='{per_second: 1000, burst_count: 10000}'
  cat >> "$dir/homeserver.yaml" <<YAML
rc_message: $fast
rc_registration: $fast
rc_login: {address: $fast, account: $fast, failed_attempts: $fast}
rc_joins: {local: $fast, remote: $fast}
rc_joins_per_room: $fast
rc_invites: {per_room: $fast, per_user: $fast, per_issuer: $fast}
rc_room_creation: $fast
rc_presence: {per_user: $fast}
rc_key_requests: $fast
YAML
fi
cat > "$dir/log.yaml" <<YAML
version: 1
formatters:
  precise: {format: '%(asctime)s %(levelname)s %(name)s %(message)s'}
handlers:
  file: {class: logging.FileHandler, filename: $dir/homeserver.log, formatter: precise}
root: {level: WARNING, handlers: [file]}
disable_existing_loggers: false
YAML
if [ ! -f "$dir/signing.key" ]; then
  "$venv/bin/python" -m synapse.app.homeserver -c "$dir/homeserver.yaml" --generate-keys >/dev/null
fi
echo "$secret"

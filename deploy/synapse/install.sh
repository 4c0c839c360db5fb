#!/usr/bin/env bash
# Installs the pinned Synapse into a venv (wheels only, no compiler) and prints the venv path.
# Idempotent.  SYNAPSE_CACHE: where (default $HOME/.cache/cultnet-gateway/synapse).
set -euo pipefail
version="1.163.2"
venv="${SYNAPSE_CACHE:-$HOME/.cache/cultnet-gateway/synapse}/$version/venv"
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import synapse" 2>/dev/null; then
  python3 -m venv "$venv" >&2
  "$venv/bin/pip" install --quiet --disable-pip-version-check "matrix-synapse==$version" >&2
fi
echo "$venv"

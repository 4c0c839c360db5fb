#!/usr/bin/env bash
# Installs the pinned claude CLI from the npm registry into a cache directory and prints the
# path of its executable. Idempotent: a second run only prints the path.
#   CLAUDE_CLI_CACHE  where to install (default: $HOME/.cache/cultnet-gateway/claude-cli)
set -euo pipefail
version="2.1.332"
cache="${CLAUDE_CLI_CACHE:-$HOME/.cache/cultnet-gateway/claude-cli}/$version"
exe="$cache/node_modules/@anthropic-ai/claude-code/bin/claude.exe"
if [ ! -x "$exe" ]; then
  mkdir -p "$cache"
  # npm warns that the package wants Node >= 22; the native binary runs on Node 20 here.
  npm install --prefix "$cache" --no-audit --no-fund --loglevel=error "@anthropic-ai/claude-code@$version" >&2
fi
if [ ! -x "$exe" ]; then
  echo "install-claude-cli: $exe missing after npm install" >&2
  exit 1
fi
echo "$exe"

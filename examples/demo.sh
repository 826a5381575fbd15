#!/usr/bin/env bash
# Offline demo of caliban's main job: a prompt that calls tools and answers, against the
# scripted stub model on loopback. No API key, no network.
set -euo pipefail
cd "$(dirname "$0")/.."

cargo build --release --quiet
bin=target/release/caliban

# Start the stub model; it prints "listening on http://127.0.0.1:PORT" once ready.
coproc STUB { exec "$bin" stub-model --script examples/demo-script.json; }
trap 'kill "$STUB_PID" 2>/dev/null || true' EXIT
read -r banner <&"${STUB[0]}"
url=${banner#listening on }
echo "stub model: $url" >&2

# The stream-json frames show each tool call and result; --allow lets the one Bash
# command through (print mode cannot ask anyone, so unlisted commands are denied).
ANTHROPIC_BASE_URL=$url "$bin" -p "What is this project?" \
  --output-format stream-json --allow 'Bash(ls:*)'

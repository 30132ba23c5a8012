#!/usr/bin/env bash
# Set up, then run the main job on the bundled examples.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
L=.venv/bin/lmpm
for f in examples/*.lmpm; do
  $L check "$f"
done
echo
echo "== lmpm show examples/video.lmpm"
$L show examples/video.lmpm

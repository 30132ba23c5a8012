#!/usr/bin/env bash
# The README's first command: set up (once), then run the seed's video program on the embedded,
# trained models — caption in, a locked patch held, the sky painted blue by a constraint — render
# it, and show what the constraints did. Then the causal text program.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/lmpm ]; then
  bash scripts/setup.sh
fi
L=.venv/bin/lmpm
# the models are small: one intra-op thread is fastest (and robust on a busy machine)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
start=$(date +%s)

echo "== lmpm check examples/video.lmpm"
$L check examples/video.lmpm --strict
echo
echo "== lmpm run examples/video.lmpm  (caption: \"$(head -c 80 examples/video/caption.txt)\")"
$L run examples/video.lmpm \
  --input Txt=examples/video/caption.txt \
  --input Vid=examples/video/patch.npy \
  --epochs 16 --seed 0 --out runs/video --force --quiet
$L render runs/video --out runs/video/render >/dev/null 2>&1
echo "video:  runs/video/render/Vid.gif   (frames: runs/video/render/Vid_*.png, sheet: Vid.png)"
[ -f runs/video/render/violations.png ] && echo "plot:   runs/video/render/violations.png"
echo
if $L trace --help >/dev/null 2>&1; then
  echo "== lmpm trace runs/video  (top)"
  $L trace runs/video 2>&1 | head -n 24 || true
  echo
fi

echo "== lmpm run examples/text.lmpm  (prompt: \"$(cat examples/text/prompt.txt)\"; lowercase only)"
$L run examples/text.lmpm --input Txt=examples/text/prompt.txt --out runs/text --force --quiet
$L render runs/text --value Txt --out runs/text/render 2>/dev/null
echo
echo "demo done in $(($(date +%s) - start)) s"

#!/usr/bin/env bash
# The README's first command: set up (once), then show inductive bias at work — the same trained
# model run alone and under the program's constraints, side by side, with the numbers and the
# trace that explains the difference. First the seed's video program on a caption the video model
# never saw as a whole (a held-out colour/direction pair), then the causal text program.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/lmpm ]; then
  bash scripts/setup.sh
fi
L=.venv/bin/lmpm
PY=.venv/bin/python
# the models are small: one intra-op thread is fastest (and robust on a busy machine)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
start=$(date +%s)
OUT=runs/demo
mkdir -p "$OUT"
# run a command silently; show its output only if it fails
quiet() { local log; log=$("$@" 2>&1) || { echo "$log"; return 1; }; }

echo "== lmpm check examples/video.lmpm"
$L check examples/video.lmpm --strict
echo
CAP=examples/video/heldout/caption.txt
echo "== video: \"$(head -c 80 $CAP)\"  (yellow + right: a pair the model never saw in training)"
echo "   model alone:  examples/video_free.lmpm  (the same program without HardLock and TextPaint)"
echo "   constrained:  examples/video.lmpm       (the seed's program)"
quiet $L run examples/video_free.lmpm --input Txt=$CAP --epochs 16 --seed 0 \
  --out $OUT/video_alone --force --quiet
quiet $L run examples/video.lmpm --input Txt=$CAP --epochs 16 --seed 0 \
  --out $OUT/video --force --quiet --trace cells
$PY scripts/compare.py $OUT/video_alone $OUT/video --value Vid --sheet $OUT/video_sheet.png \
  --labels "model alone,constrained" \
  --title "\"$(head -c 80 $CAP)\": model alone (top) vs under HardLock + TextPaint (middle)" \
  | tee $OUT/video_compare.txt
$PY scripts/compare.py $OUT/video_alone $OUT/video --value Vid --json >$OUT/video_compare.json
echo
echo "== why they differ: lmpm trace $OUT/video  (constraints, blocked proposals)"
{ $L trace $OUT/video 2>&1 || true; } | sed -n '1,/^proved at compile time/p'
# one cell each constraint decided, and its story (the trace's words, without the tables)
for NAME in TextPaint HardLock; do
  CELL=$($PY -c "import json; d=json.load(open('$OUT/video_compare.json')); \
print(next((c['example'] for c in d['constraints'] if c['name']=='$NAME' and c['example']), ''))")
  if [ -n "$CELL" ]; then
    echo
    echo "== a cell $NAME decided: lmpm trace $OUT/video --cell '$CELL'"
    { $L trace $OUT/video --cell "$CELL" 2>&1 || true; } | grep -v '^[│┏┃┡└]' | grep -v '^commits' | sed -n '2,11p'
  fi
done
echo
echo "== the model alone on held-out captions (object IoU vs the scene the caption describes)"
$PY - <<'EOF'
import json
import numpy as np
import torch
from lmpm.models import weights, world
from lmpm.models.training import motion_ok, object_iou

m = weights.metadata(weights.weights_dir() / "localgen.safetensors")["metrics"]
truth = torch.from_numpy(np.load("examples/video/heldout/scene.npy"))
yellow = world.NAMES.index("yellow")
for label, run in (("model alone", "runs/demo/video_alone"), ("constrained", "runs/demo/video")):
    vid = torch.from_numpy(np.load(f"{run}/Vid.npy"))
    iou = object_iou(vid, truth, yellow)
    moved = motion_ok(vid, yellow, "right")
    print(f"  this caption, {label:<11}: object IoU per frame {[round(float(x), 2) for x in iou]}, "
          f"moved right in {sum(moved)}/{len(moved)} frames")
copy = object_iou(truth[:-1], truth[1:], yellow)
print(f"  copy-previous-frame baseline (true frame held still), t >= 1: IoU {float(copy.mean()):.2f}")
for key, what in (("generation_heldout", "held-out pairs"), ("generation_trained", "trained pairs")):
    g = m.get(key)
    if g:
        print(f"  {what:<15} (training metrics): object IoU {g['object_iou']:.2f}, t >= 1 "
              f"{g['object_iou_t_ge_1']:.2f} vs copy-previous-frame {g['copy_prev_iou_t_ge_1']:.2f}; "
              f"moves the right way {100 * g['moves_right_way']:.0f}%; colour {100 * g['colour_fidelity']:.0f}%")
print(f"  teacher-forced token accuracy on held-out pairs: {m['accuracy_unset0']:.3f} "
      f"(changed cells {m['accuracy_on_changed_cells']:.3f}; copy-previous-frame {m['copy_prev_accuracy']:.3f})")
EOF
echo "sheet:  $OUT/video_sheet.png   (runs: $OUT/video_alone, $OUT/video; lmpm render either)"
echo

# A `require` constraint chooses among what the model proposes. The seed's rule asks for one
# sample per cell, and the model proposes the caption's white cloud with probability > 98%, so
# TextPaint has nothing blue-ish to pick there. The same two programs with 4 hotter candidates:
CALL='Model(neighbors, prev, txt, coarse)'
for F in video_free video; do
  grep -qF "$CALL" examples/$F.lmpm
  sed "s/$CALL/Model(neighbors, prev, txt, coarse, k=4, temperature=2.0)/" examples/$F.lmpm \
    >$OUT/${F}_k4.lmpm
done
echo "== the same, with 4 candidates per cell at temperature 2: $CALL -> ...(..., k=4, temperature=2.0)"
quiet $L run $OUT/video_free_k4.lmpm --input Txt=$CAP --epochs 16 --seed 0 \
  --out $OUT/video_alone_k4 --force --quiet
quiet $L run $OUT/video_k4.lmpm --input Txt=$CAP --epochs 16 --seed 0 \
  --out $OUT/video_k4 --force --quiet --trace cells
$PY scripts/compare.py $OUT/video_alone_k4 $OUT/video_k4 --value Vid \
  --sheet $OUT/video_k4_sheet.png --labels "model alone,constrained" \
  --title "the same with k=4, temperature=2.0: TextPaint now has blue-ish candidates" \
  | tee $OUT/video_k4_compare.txt
echo

PROMPT=examples/text/prompt.txt
echo "== text: prompt \"$(cat $PROMPT)\"  (ByteLM, greedy with its 8 best bytes as candidates)"
echo "   model alone:  examples/text_free.lmpm   constrained: examples/text.lmpm (Plain: lowercase)"
quiet $L run examples/text_free.lmpm --input Txt=$PROMPT --out $OUT/text_alone --force --quiet
quiet $L run examples/text.lmpm --input Txt=$PROMPT --out $OUT/text --force --quiet --trace cells
$PY scripts/compare.py $OUT/text_alone $OUT/text --value Txt --labels "model alone,constrained" \
  | tee $OUT/text_compare.txt
echo
echo "== why: lmpm trace $OUT/text  (blocked proposals)"
{ $L trace $OUT/text 2>&1 || true; } | sed -n '/^blocked proposals/,/^proved at compile time/p'
echo
echo "demo done in $(($(date +%s) - start)) s"

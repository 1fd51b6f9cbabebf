#!/usr/bin/env bash
# A job changes its world size through a checkpoint: 4 processes train the C example MLP
# (stage 2), save a checkpoint at step 5 in the background, and the job is killed with
# SIGKILL at step 7; 2 processes resume from that checkpoint (stage 3) and finish at step
# 10. Their final parameters equal those of an uninterrupted 2-process run within 1e-6
# (relative, absolute below 1), and the resumed run matched the unsharded reference at
# every step (the example checks it).
# Usage: ckpt_resume_test.sh HPSHARD_RUN HPSHARD_TRAIN_MLP HPSHARD_CKPT
set -uo pipefail
run="$1"
train="$2"
tool="$3"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

"$run" -n 4 --timeout 120 -- "$train" --steps 10 --adamw --checkpoint-dir "$work/ckpt" \
  --save-every 5 --die-at 7 >"$work/killed.log" 2>&1
grep -q "killed by signal 9" "$work/killed.log" || { cat "$work/killed.log"; echo "the job was not killed"; exit 1; }
"$tool" verify "$work/ckpt" || exit 1
"$tool" inspect "$work/ckpt" | grep -q "sharding 4 x dp 1 (4 ranks)" || { "$tool" inspect "$work/ckpt"; exit 1; }
# list: the checkpoints, latest marked; a file or a directory that is no checkpoint is passed over,
# one whose manifest does not read is named on stderr.
"$tool" list "$work/ckpt" | grep -q "step-5  (latest)" || { "$tool" list "$work/ckpt"; exit 1; }
mkdir "$work/ckpt/notes" "$work/ckpt/torn" && echo '{' >"$work/ckpt/torn/manifest.json"
echo 'not a checkpoint' >"$work/ckpt/model.safetensors"
"$tool" list "$work/ckpt" >"$work/list.out" 2>"$work/list.err" || exit 1
grep -q "torn not listed: invalid argument" "$work/list.err" && ! grep -q "notes\|model" "$work/list.err" \
  || { cat "$work/list.err"; echo "list did not name the unreadable manifest alone"; exit 1; }
# A name with a terminal escape is shown escaped, in the name and in the message's path.
mkdir "$work/ckpt/e"$'\e'"[31m" && echo '{' >"$work/ckpt/e"$'\e'"[31m/manifest.json"
"$tool" list "$work/ckpt" >"$work/list.out" 2>"$work/list.err" || exit 1
grep -q $'\e' "$work/list.err" && { cat -v "$work/list.err"; echo "list printed a raw escape"; exit 1; }
grep -qF 'e\x1b[31m/manifest.json' "$work/list.err" || { cat -v "$work/list.err"; echo "no escaped path"; exit 1; }
rm -rf "$work/ckpt/notes" "$work/ckpt/torn" "$work/ckpt/model.safetensors" "$work/ckpt/e"$'\e'"[31m"
# A latest pointer naming no checkpoint here is said (nothing is marked latest then).
cp "$work/ckpt/latest" "$work/latest.kept" && echo gone >"$work/ckpt/latest"
"$tool" list "$work/ckpt" >"$work/list.out" 2>"$work/list.err" || exit 1
grep -q "names 'gone', which is not a checkpoint here" "$work/list.err" && ! grep -q latest "$work/list.out" \
  || { cat "$work/list.err" "$work/list.out"; echo "list did not name the dangling latest pointer"; exit 1; }
mv "$work/latest.kept" "$work/ckpt/latest"

"$run" -n 2 --timeout 120 -- "$train" --steps 10 --adamw --stage 3 --checkpoint-dir "$work/ckpt" \
  --resume --dump "$work/resumed.txt" >"$work/resumed.log" 2>&1 \
  || { cat "$work/resumed.log"; echo "the resumed run failed"; exit 1; }
cat "$work/resumed.log"
grep -q "resumed from checkpoint step-5 (step 5, saved by 4 ranks at stage 2) on 2 ranks" \
  "$work/resumed.log" || { echo "did not resume from step-5"; exit 1; }

"$run" -n 2 --timeout 120 -- "$train" --steps 10 --adamw --dump "$work/uninterrupted.txt" \
  >"$work/uninterrupted.log" 2>&1 || { cat "$work/uninterrupted.log"; exit 1; }

paste "$work/resumed.txt" "$work/uninterrupted.txt" | awk '
  { n++; d = $1 - $2; if (d < 0) d = -d; m = $2 < 0 ? -$2 : $2; if (m < 1) m = 1;
    if (d > 1e-6 * m) { bad++; if (bad <= 5) print "element " n ": resumed " $1 ", uninterrupted " $2 } }
  END { print n " parameters compared, " bad + 0 " differ"; exit (n == 0 || bad > 0) }'

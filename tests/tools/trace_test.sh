#!/usr/bin/env bash
# The timeline between processes: the C training example at 2 ranks under hpshard-run with
# HPS_TRACE=DIR writes one trace per rank; hpshard-trace merges them into one Chrome trace
# with both ranks, their collectives (operation, bytes, group, sequence) on the
# communicators' tracks and the step boundaries. A file that is not a trace is refused,
# naming it, and nothing is written.
# Usage: trace_test.sh HPSHARD_RUN TRAIN_MLP HPSHARD_TRACE
set -euo pipefail
run="$1"
train="$2"
tool="$3"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT

HPS_TRACE="$out/trace" "$run" -n 2 --timeout 120 -- "$train" --steps 3 --stage 3 \
  >"$out/log.txt" 2>&1 || { cat "$out/log.txt"; exit 1; }
ls "$out/trace"/hpshard-trace-rank0-* "$out/trace"/hpshard-trace-rank1-* >/dev/null
"$tool" merge -o "$out/timeline.json" "$out/trace" | grep -q 'events from'

/usr/bin/python3 - "$out/timeline.json" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
events = doc["traceEvents"]
names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
         if e["ph"] == "M" and e["name"] == "thread_name"}
for rank in (0, 1):
    mine = [e for e in events if e["pid"] == rank and e["ph"] != "M"]
    assert mine, f"rank {rank} has no events"
    colls = [e for e in mine if e.get("cat") == "collective"]
    ops = {e["name"] for e in colls}
    assert {"reduce_scatter", "all_gather"} <= ops, ops
    for e in colls:
        assert e["ph"] == "X" and e["dur"] >= 0, e
        assert e["args"]["bytes"] > 0 and e["args"]["sequence"] > 0, e
        assert names[(rank, e["tid"])].startswith("communicator '"), names[(rank, e["tid"])]
    steps = [e for e in mine if e.get("cat") == "step"]
    assert len(steps) >= 3, steps
    procs = [e for e in events if e["ph"] == "M" and e["name"] == "process_name"
             and e["pid"] == rank]
    assert len(procs) == 1 and procs[0]["args"]["name"].startswith(f"rank {rank} "), procs
    # The run's id (hpshard-run's HPS_JOB_ID): files of two runs in one directory tell apart.
    assert ", job " in procs[0]["args"]["name"], procs
print("merged timeline: ok")
PY

echo '{"x": 1}' >"$out/bad.json"
if "$tool" merge -o "$out/never.json" "$out/bad.json" 2>"$out/err.txt"; then
  echo "a file without traceEvents was merged"; exit 1
fi
grep -q "bad.json" "$out/err.txt" || { cat "$out/err.txt"; exit 1; }
[ ! -e "$out/never.json" ] || { echo "output written after an error"; exit 1; }
# Hostile inputs: nesting 100,000 deep (dumped recursively it overflowed the stack), and
# dropped-event counts whose total overflows, are refused naming the file.
/usr/bin/python3 -c 'print("[{\"ph\": \"M\", \"args\": " + "[" * 100000 + "]" * 100000 + "}]")' \
  >"$out/deep.json"
if "$tool" merge -o "$out/never.json" "$out/deep.json" 2>"$out/err.txt"; then
  echo "a file nested 100000 deep was merged"; exit 1
fi
grep -q "deep.json' nests arrays and objects deeper than" "$out/err.txt" || { cat "$out/err.txt"; exit 1; }
echo '{"traceEvents": [], "otherData": {"dropped_events": 18446744073709551615}}' >"$out/many.json"
cp "$out/many.json" "$out/many-too.json"
if "$tool" merge -o "$out/never.json" "$out/many.json" "$out/many-too.json" 2>"$out/err.txt"; then
  echo "dropped_events past 2^64 were merged"; exit 1
fi
grep -q "overflows the total" "$out/err.txt" || { cat "$out/err.txt"; exit 1; }
[ ! -e "$out/never.json" ] || { echo "output written after an error"; exit 1; }
# Events are streamed out file by file: a bad file after good ones still leaves nothing, not
# even the partial file.
if "$tool" merge -o "$out/never.json" "$out/trace" "$out/bad.json" 2>"$out/err.txt"; then
  echo "a bad file after good ones was merged"; exit 1
fi
grep -q "bad.json" "$out/err.txt" || { cat "$out/err.txt"; exit 1; }
[ ! -e "$out/never.json" ] || { echo "output written after an error"; exit 1; }
if compgen -G "$out/never.json*" >/dev/null; then
  echo "a temporary was left after an error:" $out/never.json*; exit 1
fi
# The merge writes a temporary of its own: a file of another name beside the output (the
# fixed "OUT.partial" it once truncated) is left as it was, and concurrent merges to one
# output each publish a whole trace.
echo precious >"$out/timeline.json.partial"
pids=()
for i in 1 2 3 4; do
  "$tool" merge -o "$out/timeline.json" "$out/trace" >/dev/null & pids+=($!)
done
for p in "${pids[@]}"; do wait "$p" || { echo "a concurrent merge failed"; exit 1; }; done
[ "$(cat "$out/timeline.json.partial")" = precious ] || { echo "a bystander file was truncated"; exit 1; }
/usr/bin/python3 -c 'import json, sys; json.load(open(sys.argv[1]))' "$out/timeline.json" ||
  { echo "concurrent merges left a broken trace"; exit 1; }
if compgen -G "$out/timeline.json.tmp-*" >/dev/null; then echo "a temporary was left"; exit 1; fi
# Entries of a directory that are not regular files (symbolic links leading nowhere, a FIFO)
# are skipped whatever the listing's order: the merge failed ("cannot list the directory")
# when a dangling link came last.
mkdir "$out/mixed"
cp "$out"/trace/hpshard-trace-rank0-* "$out/mixed/"
for name in a b.json c m.json x y.json z zz.json; do ln -s "$out/nowhere" "$out/mixed/$name"; done
mkfifo "$out/mixed/fifo.json"
"$tool" merge -o "$out/mixed.json" "$out/mixed" >"$out/mixed.txt" 2>&1 ||
  { cat "$out/mixed.txt"; exit 1; }
grep -q 'events from 1 ' "$out/mixed.txt" || { cat "$out/mixed.txt"; exit 1; }
# The output replaces a regular file; a symbolic link is followed (its file replaced, the
# link kept); a FIFO, a directory or a device there is refused and left as it was (the
# rename replaced it: as root, `-o /dev/full` replaced the device node).
mkfifo "$out/fifo"
mkdir "$out/outdir"
for bad in "$out/fifo" "$out/outdir"; do
  if "$tool" merge -o "$bad" "$out/trace" 2>"$out/err.txt"; then
    echo "merged over $bad"; exit 1
  fi
  grep -q "not a regular file" "$out/err.txt" || { cat "$out/err.txt"; exit 1; }
done
[ -p "$out/fifo" ] && [ -d "$out/outdir" ] || { echo "a refused output was replaced"; exit 1; }
echo old >"$out/outdir/real.json"
ln -s "$out/outdir/real.json" "$out/link.json"
"$tool" merge -o "$out/link.json" "$out/trace" | grep -q 'events from'
[ -L "$out/link.json" ] && grep -q traceEvents "$out/outdir/real.json" ||
  { echo "a symbolic link was not followed"; exit 1; }
# The output takes the mode of the file it replaces: a private trace stays private (it became
# 0644, readable to everyone); a new one is 0666 less the umask.
chmod 600 "$out/timeline.json"
"$tool" merge -o "$out/timeline.json" "$out/trace" | grep -q 'events from'
[ "$(stat -c %a "$out/timeline.json")" = 600 ] ||
  { echo "merging over a 0600 file made it $(stat -c %a "$out/timeline.json")"; exit 1; }
(umask 077 && "$tool" merge -o "$out/fresh.json" "$out/trace" >/dev/null)
[ "$(stat -c %a "$out/fresh.json")" = 600 ] || { echo "a new output ignored the umask"; exit 1; }
(umask 002 && "$tool" merge -o "$out/shared.json" "$out/trace" >/dev/null)
[ "$(stat -c %a "$out/shared.json")" = 664 ] || { echo "a new output is not 0666 less the umask"; exit 1; }
# Two runs of one rank in one directory (HPS_TRACE reused): the second rank 0's file names
# row 0 for another process. They are refused, naming both files, rather than drawn on one
# row with their tracks interleaved; each run's files merge on their own.
mkdir "$out/two-runs"
cp "$out"/trace/hpshard-trace-rank*.json "$out/two-runs/"
first=$(ls "$out"/trace/hpshard-trace-rank0-*.json | head -n 1)
/usr/bin/python3 - "$first" "$out/two-runs/hpshard-trace-rank0-pid999999999-0.json" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
for e in doc["traceEvents"]:
    if e["ph"] == "M" and e["name"] == "process_name":
        e["args"]["name"] = "rank 0 (pid 999999999)"
json.dump(doc, open(sys.argv[2], "w"))
PY
if "$tool" merge -o "$out/never.json" "$out/two-runs" 2>"$out/err.txt"; then
  echo "two processes of rank 0 were merged onto one row"; exit 1
else
  rc=$?
fi
[ "$rc" = 1 ] || { echo "exit $rc, not 1"; cat "$out/err.txt"; exit 1; }
grep -q "$(basename "$first")' and '.*pid999999999-0.json' hold one row (pid 0) for two processes" \
  "$out/err.txt" || { cat "$out/err.txt"; exit 1; }
[ ! -e "$out/never.json" ] || { echo "output written after an error"; exit 1; }
# Two processes of one name and pid (two containers sharing the directory, or two hosts): the
# library's files tell them apart by the process id beside the name, and they are refused too.
mkdir "$out/two-namespaces"
cp "$out"/trace/hpshard-trace-rank*.json "$out/two-namespaces/"
/usr/bin/python3 - "$first" "$out/two-namespaces/hpshard-trace-rank0-pid1-0.json" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
for e in doc["traceEvents"]:
    if e["ph"] == "M" and e["name"] == "process_name":
        assert e["args"]["hpshard_process"], e
        e["args"]["hpshard_process"] = "another-process"
json.dump(doc, open(sys.argv[2], "w"))
PY
if "$tool" merge -o "$out/never.json" "$out/two-namespaces" 2>"$out/err.txt"; then
  echo "two processes of one name on rank 0 were merged onto one row"; exit 1
fi
grep -q "of one name: in other pid namespaces or on other hosts" "$out/err.txt" ||
  { cat "$out/err.txt"; exit 1; }
# One file named twice (the directory and its files, or through a link) is merged once: its
# events were drawn twice, each span overlapping its twin.
once=$("$tool" merge -o "$out/once.json" "$out/trace" | sed 's/.*: \([0-9]*\) events.*/\1/')
ln -s "$out/trace" "$out/trace-link"
twice=$("$tool" merge -o "$out/twice.json" "$out/trace" "$out"/trace/*.json "$out/trace-link" |
  sed 's/.*: \([0-9]*\) events.*/\1/')
[ "$once" = "$twice" ] || { echo "the same files named twice gave $twice events, not $once"; exit 1; }
# An earlier merge's output in the ranks' directory is left out, with a note; named on its
# own it is refused.
cp -r "$out/trace" "$out/with-merged"
cp "$out/once.json" "$out/with-merged/timeline.json"
again=$("$tool" merge -o "$out/again.json" "$out/with-merged" 2>"$out/err.txt" |
  sed 's/.*: \([0-9]*\) events.*/\1/')
[ "$again" = "$once" ] || { echo "a merged file beside the ranks' gave $again events"; exit 1; }
grep -q "left out '.*timeline.json': a merged trace" "$out/err.txt" || { cat "$out/err.txt"; exit 1; }
if "$tool" merge -o "$out/never.json" "$out/once.json" 2>"$out/err.txt"; then
  echo "a merged trace was merged again"; exit 1
fi
grep -q "is a merged trace" "$out/err.txt" || { cat "$out/err.txt"; exit 1; }
# Named on its own after its directory: refused all the same.
if "$tool" merge -o "$out/never.json" "$out/with-merged" "$out/with-merged/timeline.json" \
  2>"$out/err.txt"; then
  echo "a merged trace named after its directory was merged"; exit 1
fi
grep -q "is a merged trace" "$out/err.txt" || { cat "$out/err.txt"; exit 1; }
# A directory holding only an earlier merge: nothing to merge.
mkdir "$out/only-merged"
cp "$out/once.json" "$out/only-merged/"
if "$tool" merge -o "$out/never.json" "$out/only-merged" 2>"$out/err.txt"; then
  echo "a directory of merged traces only gave a trace"; exit 1
fi
grep -q "no rank's trace file" "$out/err.txt" || { cat "$out/err.txt"; exit 1; }
[ ! -e "$out/never.json" ] || { echo "output written after an error"; exit 1; }
# Names from the file system are shown with their control bytes escaped.
bad_name="$out/esc"$'\033'"[31mred.json"
echo 'not json' >"$bad_name"
if "$tool" merge -o "$out/never.json" "$bad_name" 2>"$out/err.txt"; then
  echo "a file that is not JSON was merged"; exit 1
fi
grep -q 'esc\\x1b\[31mred.json' "$out/err.txt" || { cat -v "$out/err.txt"; exit 1; }
if grep -q $'\033' "$out/err.txt"; then echo "an escape byte reached the terminal"; exit 1; fi
echo "trace test: ok"

#!/bin/bash
# The single-message translation arms (messages.yaml: full; Linformer k = 4 with the decoder rule; Linformer k = 4
# in the encoder only) for the given seeds, all at once on one GPU machine: one `zoo compare` process per arm and
# seed, each in its own copy of the tree, all three arms of a seed on the same device (the verdicts pair by seed).
# The runs read the same corpus, BPE and tokenised splits as the CPU runs: the bundle carries this machine's German
# gettext catalogs (restored at the same path with the same modification times, which key the corpus cache) and
# its translation cache, and the wheels the device's Python lacks (jsonargparse and its signature extras) or has at
# another version (tokenizers, sacrebleu). The script checks that the cache took no new entry.
#   here:            bash experiments/studies/translation/run_arms_gpu.sh --bundle      # builds .gpu/ (git-ignored)
#   on the GPU:      bash experiments/studies/translation/run_arms_gpu.sh 1 2           # seeds; .gpu/ copied along
# Results are written to $OUT/runs.tgz (default runs/gpu_out/; checkpoints left out); copy each seed-N folder into
# runs/<experiment>/<label>/, and `zoo compare ... --seeds N+1` writes the summary without re-running them.
# REHEARSAL=1 runs it here with tiny settings (3 steps, one val and test batch).
set -u
if [ "${1:-}" = "--bundle" ]; then
  rm -rf .gpu && mkdir -p .gpu/whl .gpu/locale .gpu/cache
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .gpu/whl \
    jsonargparse==4.53.0 docstring_parser==0.18.0 typeshed_client==2.15.0 tokenizers==0.23.3 sacrebleu==2.6.0
  cp -p /usr/share/locale/de/LC_MESSAGES/*.mo .gpu/locale/
  cp -rp "${ZOO_CACHE:-$HOME/.cache/attention-zoo}/translation" .gpu/cache/
  python3 -c "import glob, json, os; json.dump({os.path.basename(p): os.stat(p).st_mtime_ns for p in sorted(glob.glob('.gpu/locale/*.mo'))}, open('.gpu/mtimes.json', 'w'))"
  exit 0
fi
t0=$(date +%s)
deadline=${DEADLINE:-520}
out=${OUT:-runs/gpu_out}; mkdir -p "$out"
root=$PWD
if [ -z "${REHEARSAL:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl || exit 1
  site=/tmp/site
  # the catalogs the CPU runs read, at the same path and with the same modification times (the corpus cache key)
  if rm -rf /usr/share/locale/de/LC_MESSAGES && mkdir -p /usr/share/locale/de/LC_MESSAGES; then
    cp .gpu/locale/*.mo /usr/share/locale/de/LC_MESSAGES/ && locale_args=()
  else
    mkdir -p /tmp/locale/de/LC_MESSAGES && cp .gpu/locale/*.mo /tmp/locale/de/LC_MESSAGES/ && locale_args=(--data.locale_dir /tmp/locale)
  fi
  python3 - <<'EOF'
import json, os, glob
for d in ("/usr/share/locale/de/LC_MESSAGES", "/tmp/locale/de/LC_MESSAGES"):
    for name, ns in json.load(open(".gpu/mtimes.json")).items():
        if os.path.exists(f"{d}/{name}"):
            os.utime(f"{d}/{name}", ns=(ns, ns))
EOF
  export ZOO_CACHE=/tmp/zoocache; mkdir -p $ZOO_CACHE && cp -r .gpu/cache/translation $ZOO_CACHE/
  extra=()
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
else
  site=""; locale_args=(); export ZOO_CACHE=${ZOO_CACHE:-$HOME/.cache/attention-zoo}
  extra=(--trainer.max_steps=3 --trainer.val_check_interval=2 --model.bleu_sentences=4 --trainer.limit_val_batches=1 --trainer.limit_test_batches=1)
fi
ls $ZOO_CACHE/translation | sort > "$out/cache_before.txt"
PYTHONPATH=$site python3 -c "import sys, torch, lightning, tokenizers, sacrebleu, jsonargparse; print(sys.version.split()[0], 'torch', torch.__version__, 'lightning', lightning.__version__, 'tokenizers', tokenizers.__version__, 'sacrebleu', sacrebleu.__version__, 'jsonargparse', jsonargparse.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')"
echo "setup $(( $(date +%s) - t0 )) s"

config=configs/studies/translation/messages.yaml
pids=(); names=()
launch() {  # name seed args...
  local name=$1 seed=$2; shift 2
  local dir=/tmp/w/$name-s$seed
  mkdir -p /tmp/w && rm -rf "$dir" && mkdir "$dir"
  tar -C "$root" --exclude=./.gpu --exclude=./.git --exclude=./runs -cf - . | tar -C "$dir" -xf -
  (cd "$dir" && PYTHONPATH="$dir${site:+:$site}" PYTHONUNBUFFERED=1 exec python3 -m experiments.cli compare --config $config \
     --seed "$seed" --seeds 1 "$@" > "$dir/compare.log" 2>&1) &
  pids+=($!); names+=("$name-s$seed")
}
for s in "$@"; do
  launch full "$s" --attentions full --experiment tr-msg-full -- "${locale_args[@]}" "${extra[@]}"
  launch k4 "$s" --attentions linformer:k=4 --experiment tr-msg-linformer-k4 -- \
    --model.decoder_attention_options "{block_size: 4, block_k: 1}" "${locale_args[@]}" "${extra[@]}"
  launch k4enc "$s" --attentions linformer:k=4 --experiment tr-msg-linformer-k4-encoder -- \
    --model.decoder_attention full "${locale_args[@]}" "${extra[@]}"
done
echo "launched ${names[*]} at $(( $(date +%s) - t0 )) s"

while :; do
  sleep 15
  alive=0; for p in "${pids[@]}"; do kill -0 $p 2>/dev/null && alive=$((alive + 1)); done
  el=$(( $(date +%s) - t0 ))
  if (( el % 60 < 15 )) || (( alive == 0 )); then
    echo "--- ${el} s, ${alive} running"
    for n in "${names[@]}"; do
      f=$(ls /tmp/w/$n/runs/*/*/seed-*/fit.log 2>/dev/null | head -1)
      c=$(ls /tmp/w/$n/runs/*/*/seed-*/checkpoints/ 2>/dev/null | tr '\n' ' ')
      echo "$n: ckpts [$c] $(tail -c 160 /tmp/w/$n/compare.log | tr '\n\r' '  ')"
    done
    [ -z "${REHEARSAL:-}" ] && nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
  fi
  (( alive == 0 )) && break
  if (( el > deadline )); then echo "deadline: stopping ${alive} runs"; for p in "${pids[@]}"; do kill -INT $p 2>/dev/null; done; sleep 10; break; fi
done
ls $ZOO_CACHE/translation | sort > "$out/cache_after.txt"
diff "$out/cache_before.txt" "$out/cache_after.txt" && echo "cache: no new entries (same corpus, BPE and tokenised splits as the CPU runs)"
for n in "${names[@]}"; do cp /tmp/w/$n/compare.log "/tmp/w/$n/runs/compare-$n.log" 2>/dev/null; done
tar -C /tmp/w --exclude='checkpoints' -czf "$out/runs.tgz" $(cd /tmp/w && ls -d */runs)
ls -la "$out"
echo "total $(( $(date +%s) - t0 )) s"

#!/usr/bin/env bash
# The data-pipeline experiment: Debian's documentation HTML, packed into WARC files, through lmlab's pipeline in
# three variants; the default model trained on each and evaluated on the same clean held-out text.
#   raw       extraction only (every language, navigation and boilerplate, duplicates)
#   filtered  English (py3langid), Gopher quality and repetition rules, PII masking
#   clean     filtered, then exact and MinHash deduplication (conf/pipeline/web.yaml)
#   main      clean, extracted with resiliparse's main-content heuristics (menus and page navigation dropped)
# Needs: apt-get install debian-reference-{en,de,es,fr,it,ja,pt,zh-cn} debian-handbook python3-doc
# Usage: experiments/data/run.sh [OUT_DIR] (STEPS=600 training steps, WORKERS=2 pipeline processes)
set -euo pipefail
D=${1:-outputs/data-experiment}
STEPS=${STEPS:-600}; WORKERS=${WORKERS:-2}
HERE=$(dirname "$0")
mkdir -p "$D"
[ -f "$D/heldout.txt" ] || python "$HERE/make_warcs.py" "$D/warc" --heldout "$D/heldout.txt"
FILTERS="{name: language, languages: [en]},gopher,repetition,pii"
for variant in raw filtered clean main; do
    extract=()
    case $variant in
        raw) stages="pipeline.stages=[]" ;;
        filtered) stages="pipeline.stages=[$FILTERS]" ;;
        clean) stages="pipeline.stages=[$FILTERS,exact_dedup,minhash]" ;;
        main) stages="pipeline.stages=[$FILTERS,exact_dedup,minhash]"
              extract=("pipeline.reader.extractor={name: resiliparse, main_content: true}") ;;
    esac
    lmlab data run pipeline=web "input=$D/warc" "output=$D/$variant" "${extract[@]}" "$stages" executor.workers=$WORKERS \
        | tee "$D/$variant.funnel.md"
done
for variant in raw filtered clean main; do
    lmlab-train data=text_files "data.paths=[$D/$variant/shards]" trainer.max_steps=$STEPS trainer.progress_bar=false \
        ckpt_path=auto "hydra.run.dir=$D/train-$variant" 2>&1 | tail -1
    [ -f "$D/eval-$variant/results.json" ] || lmlab eval "ckpt=$D/train-$variant/checkpoints/last.ckpt" eval=perplexity "eval.perplexity.path=$D/heldout.txt" \
        "out=$D/eval-$variant" > /dev/null
done
python - "$D" <<'PY'
import json, sys
from pathlib import Path
d = Path(sys.argv[1])
print("| variant | documents | MB of text | held-out bits per byte | held-out perplexity |\n|---|---:|---:|---:|---:|")
for v in ("raw", "filtered", "clean", "main"):
    stats = json.loads((d / v / "stats.json").read_text())
    last = list(stats.values())[-1]
    ppl = json.loads((d / f"eval-{v}" / "results.json").read_text())["tasks"]["perplexity"]["metrics"]
    print(f"| {v} | {last['docs_out']:,} | {last['bytes_out'] / 1e6:.1f} | {ppl['bpb']:.3f} | {ppl['ppl']:.1f} |")
PY

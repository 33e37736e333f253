#!/bin/bash
# The routing traces the learned eviction policy is trained and validated on (docs/results.md, "Learned
# eviction"), into build/evict/: the demo model's held-out text (2,000 tokens, split 1,000 / 1,000 by
# bench/train_eviction.py's caller) and its own text; the bench geometry (qwen3moe) and two other families with
# random weights (the bench preset, experts 64 wide, Q8_0), two prompts each (a: training, b: held out).
set -e
cd "$(dirname "$0")/.."
TW=.venv/bin/tokenwing
D=build/evict
mkdir -p $D
$TW repack resources/demo-model/tokenwing-demo-moe.gguf -o $D/demo.tw.gguf >/dev/null
.venv/bin/python resources/demo-model/trace_heldout.py $D/demo.tw.gguf --out $D/demo-heldout.npz --tokens 2000 --lookahead 2
.venv/bin/python -c "
from tokenwing.streaming.trace import Trace, load_trace
t = load_trace('$D/demo-heldout.npz')
for name, a, b in (('h1', 0, 1000), ('h2', 1000, 2000)):
    Trace(t.selected[a:b], t.predicted[a:b], t.prompt_tokens[a:b], t.layers, t.n_expert).save(f'$D/demo-{name}.npz')
"
$TW run $D/demo.tw.gguf --prompt $'ACT I\nSCENE I. London. The palace.\n' -n 300 --temp 0.8 --seed 1 --ram-budget 25% \
  --lookahead 2 --record-trace $D/demo-gen.npz >/dev/null
for spec in "qwen3moe 400" "deepseek2 160" "gpt-oss 160"; do
  set -- $spec
  if [ ! -f $D/$1.tw.gguf ]; then
    $TW testmodel $D/$1.gguf --arch $1 --preset bench --n-ff-exp 64 --type Q8_0 >/dev/null
    $TW repack $D/$1.gguf -o $D/$1.tw.gguf >/dev/null && rm $D/$1.gguf
  fi
  $TW run $D/$1.tw.gguf --prompt "The weather today is" -n $2 --temp 0.8 --seed 1 --ram-budget 25% --lookahead 2 \
    --record-trace $D/$1-a.npz >/dev/null
  $TW run $D/$1.tw.gguf --prompt "Once upon a time, in a land" -n $2 --temp 0.8 --seed 2 --ram-budget 25% \
    --lookahead 2 --record-trace $D/$1-b.npz >/dev/null
done
for z in "08 0.8 0.2" "12 1.2 0.4"; do
  set -- $z
  $TW trace synth $D/synth-$1.npz --tokens 2000 --layers 12 --experts 128 --k 8 --zipf $2 --locality $3 --seed 0
done

#!/bin/bash
# The routing traces the learned eviction policy is trained and validated on (docs/results.md, "Learned
# eviction"), into build/evict/: the demo model's held-out text (2,000 tokens, split 1,000 / 1,000 by
# bench/train_eviction.py's caller) and its own text; the bench geometry (qwen3moe, random weights, the bench preset
# with experts 64 wide, Q8_0; two prompts: a for training, b held out) and deepseek2 (held out).
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
if [ ! -f $D/qwen3moe.tw.gguf ]; then
  $TW testmodel $D/qwen3moe.gguf --arch qwen3moe --preset bench --n-ff-exp 64 --type Q8_0 >/dev/null
  $TW repack $D/qwen3moe.gguf -o $D/qwen3moe.tw.gguf >/dev/null && rm $D/qwen3moe.gguf
fi
$TW run $D/qwen3moe.tw.gguf --prompt "The weather today is" -n 400 --temp 0.8 --seed 1 --ram-budget 25% --lookahead 2 \
  --record-trace $D/qwen3moe-a.npz >/dev/null
$TW run $D/qwen3moe.tw.gguf --prompt "Once upon a time, in a land" -n 400 --temp 0.8 --seed 2 --ram-budget 25% \
  --lookahead 2 --record-trace $D/qwen3moe-b.npz >/dev/null
# A second family, never trained on: deepseek2's small preset with 64 experts, top-8 (the bench preset's deepseek2
# decoded at 0.1-0.4 tok/s on the shared machine).
if [ ! -f $D/ds-small.tw.gguf ]; then
  $TW testmodel $D/ds-small.gguf --arch deepseek2 --preset small --n-expert 64 --n-expert-used 8 --type Q8_0 >/dev/null
  $TW repack $D/ds-small.gguf -o $D/ds-small.tw.gguf >/dev/null && rm $D/ds-small.gguf
fi
$TW run $D/ds-small.tw.gguf --prompt "The weather today is" -n 200 --temp 0.8 --seed 1 --ram-budget 25% --lookahead 2 \
  --record-trace $D/ds-small-a.npz >/dev/null
for z in "08 0.8 0.2" "12 1.2 0.4"; do
  set -- $z
  $TW trace synth $D/synth-$1.npz --tokens 2000 --layers 12 --experts 128 --k 8 --zipf $2 --locality $3 --seed 0
done

"""The shipped learned eviction model (written by bench/train_eviction.py; its recipe is in `MODEL["recipe"]`)."""

MODEL: dict[str, object] = {
    "half_lives": [2.0, 8.0, 32.0, 128.0, 512.0],
    "weights": [
        -0.20246371373962874,
        -0.4442602229245218,
        0.05164441350156546,
        0.8654237584136794,
        1.0835450521189873,
        -0.44941868944817764,
    ],
    "bias": 0.0,
    "recipe": "python bench/train_eviction.py --train demo-h1.npz qwen3moe-a.npz --slots 25%",
}

"""llama.cpp's references for the device tests, made here for the GPU machine (no llama.cpp there): every case of
tests/compute/test_vram.py (`CASES`), its GGUF, its logits and the checksum tying them together, into one folder
(`bench/gpu_carry.sh` puts it in build/gpu-carry/refs; gpu_check.sh points TOKENWING_TEST_REFS at it).

    python bench/gpu_refs.py OUT_DIR
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests' cases and llama.cpp runner

from tests.compute.references import SAVE_ENV, reference
from tests.compute.test_vram import CASES, N_DECODE, N_PROMPT
from tests.oracle.test_logits import _tokens
from tokenwing.testmodel import preset_shape, write_test_model


def main() -> int:
    out = Path(sys.argv[1])
    os.environ[SAVE_ENV] = str(out)
    with tempfile.TemporaryDirectory() as tmp:
        for key, (type_name, shape, seed) in CASES.items():
            args = dict(shape)
            preset = str(args.pop("preset", "tiny"))
            arch = args.pop("arch", None)
            src = Path(tmp) / f"{key}.gguf"
            write_test_model(str(src), preset_shape(preset, arch).with_(**args), type_name)  # type: ignore[arg-type]
            (out / f"{key}.gguf").parent.mkdir(parents=True, exist_ok=True)
            os.replace(src, out / f"{key}.gguf")
            tokens = _tokens(N_PROMPT + N_DECODE, 512, seed=seed)
            reference(key, out / f"{key}.gguf", tokens, Path(tmp))
            print(key, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

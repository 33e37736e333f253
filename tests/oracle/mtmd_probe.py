"""Subprocess: llama.cpp's libmtmd on an image (llama.cpp's ggml must not share our process).

usage: python mtmd_probe.py MODEL.gguf MMPROJ.gguf IMAGE.npy TEXT OUT_DIR [f16kv] [flash] [ctx=N]

IMAGE.npy holds the image's RGB bytes (height, width, 3) as mtmd_bitmap_init takes them; TEXT has one
`<__media__>` where the image goes. Writes OUT_DIR/embd.npy (the image chunk's embeddings from mtmd_encode_chunk +
mtmd_get_output_embd: (n_tokens, n_embd × (1 + deepstack layers))), OUT_DIR/logits.npy (the last position's logits
after mtmd_helper_eval_chunks: (1, n_vocab)), OUT_DIR/step.npy (a greedy decode step's after it) and
OUT_DIR/info.json (the chunks' token counts and n_past). The
encoder without flash attention (`flash`: with it, F16 keys and values: llama.cpp's own distance when only rounding
changes) and the text model with an F32 KV cache (`f16kv`: F16), as the oracles run it; a context of 512 positions
(`ctx=N`: N, for an image of more rows).
"""

from __future__ import annotations

import ctypes
import json
import sys
from pathlib import Path

import numpy as np


def main() -> int:
    import llama_cpp
    from llama_cpp import mtmd_cpp as mtmd

    from tokenwing.testmodel.oracle import oracle_llama

    model, mmproj, image_path, text, out_dir = sys.argv[1:6]
    out = Path(out_dir)
    n_ctx = next((int(a[4:]) for a in sys.argv[6:] if a.startswith("ctx=")), 512)
    llm = oracle_llama(llama_cpp, model, n_ctx=n_ctx, n_batch=512, f16_kv="f16kv" in sys.argv[6:])
    params = mtmd.mtmd_context_params_default()
    params.use_gpu = False
    params.n_threads = 2
    params.flash_attn_type = 1 if "flash" in sys.argv[6:] else 0  # CLIP_FLASH_ATTN_TYPE_DISABLED: F32, as ours
    params.warmup = False
    ctx = mtmd.mtmd_init_from_file(mmproj.encode(), llm.model, params)
    assert ctx, "mtmd_init_from_file failed"

    rgb = np.ascontiguousarray(np.load(image_path), dtype=np.uint8)
    data = (ctypes.c_uint8 * rgb.size).from_buffer_copy(rgb.tobytes())
    bitmap = mtmd.mtmd_bitmap_init(rgb.shape[1], rgb.shape[0], data)
    chunks = mtmd.mtmd_input_chunks_init()
    raw = text.encode()
    inp = mtmd.mtmd_input_text(text=raw, text_len=len(raw), add_special=False, parse_special=True)
    bitmaps = (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap)
    rc = mtmd.mtmd_tokenize(ctx, chunks, ctypes.byref(inp), bitmaps, 1)
    assert rc == 0, f"mtmd_tokenize: {rc}"

    info: dict[str, object] = {"chunks": []}
    p0 = 0
    for i in range(mtmd.mtmd_input_chunks_size(chunks)):
        chunk = mtmd.mtmd_input_chunks_get(chunks, i)
        kind = mtmd.mtmd_input_chunk_get_type(chunk)
        n = mtmd.mtmd_input_chunk_get_n_tokens(chunk)
        entry: dict[str, object] = {"type": int(kind), "n_tokens": int(n)}
        entry["n_pos"] = int(mtmd.mtmd_input_chunk_get_n_pos(chunk))
        if kind == mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT:
            n_tok = ctypes.c_size_t()
            toks = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n_tok))
            entry["tokens"] = [int(toks[j]) for j in range(n_tok.value)]
        else:
            assert mtmd.mtmd_encode_chunk(ctx, chunk) == 0
            embd = mtmd.mtmd_get_output_embd(ctx)
            per = llama_cpp.llama_model_n_embd_inp(llm.model)  # the text width × (1 + deepstack layers)
            np.save(out / "embd.npy", np.ctypeslib.as_array(embd, shape=(n * per,)).reshape(n, per).copy())
            image = mtmd.mtmd_input_chunk_get_tokens_image(chunk)
            entry["nx"] = int(mtmd.mtmd_image_tokens_get_nx(image))
            entry["ny"] = int(mtmd.mtmd_image_tokens_get_ny(image))
            # the rows' decoder positions where the helper puts them: after the positions of the chunks before
            pos = (mtmd.mtmd_decoder_pos * n)()
            mtmd.mtmd_helper_image_get_decoder_pos(image, p0, pos)
            entry["p0"] = p0
            entry["decoder_pos"] = [[int(q.t), int(q.y), int(q.x), int(q.z)] for q in pos]
        p0 += int(entry["n_pos"])
        info["chunks"].append(entry)  # type: ignore[attr-defined]

    new_n_past = llama_cpp.llama_pos(0)
    rc = mtmd.mtmd_helper_eval_chunks(ctx, llm.ctx, chunks, 0, 0, 512, True, ctypes.byref(new_n_past))
    assert rc == 0, f"mtmd_helper_eval_chunks: {rc}"
    info["n_past"] = int(new_n_past.value)
    logits = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    n_vocab = llm.n_vocab()
    last = np.ctypeslib.as_array(logits, shape=(n_vocab,)).reshape(1, n_vocab).copy()
    np.save(out / "logits.npy", last)
    # one decode step after the prompt: its greedy token at the next position (llama.cpp places it after the
    # image's positions, not its rows), OUT_DIR/step.npy
    token = int(last.argmax())
    info["step_token"] = token
    assert llama_cpp.llama_decode(llm.ctx, llama_cpp.llama_batch_get_one((llama_cpp.llama_token * 1)(token), 1)) == 0
    step = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    np.save(out / "step.npy", np.ctypeslib.as_array(step, shape=(n_vocab,)).reshape(1, n_vocab).copy())
    (out / "info.json").write_text(json.dumps(info))
    mtmd.mtmd_input_chunks_free(chunks)
    mtmd.mtmd_bitmap_free(bitmap)
    mtmd.mtmd_free(ctx)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

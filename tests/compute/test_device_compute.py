"""The device compute layer (compute/backend.py) on each device ggml shows — lavapipe without a GPU — against
ggml's CPU backend running the same graph: matrix products on F32/Q8_0/Q4_K/MXFP4 weights, an expert pool in VRAM
filled from a RAM pool, an attention block, get_rows and top-k, and graphs split between the device and the CPU.

Sizes are small: lavapipe is ~50× slower than the CPU backend and compiles each shader on first use.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from tests.compute.conftest import device
from tokenwing.compute import ggml_lib
from tokenwing.compute.backend import (
    Backend,
    DeviceGraph,
    DeviceMemoryError,
    DeviceTensors,
    HostBuffer,
    Readback,
    get_tensor,
)
from tokenwing.compute.devices import list_devices
from tokenwing.compute.ggml_lib import F32, I32, Tensor

ggml = ggml_lib.ops
Q8_0, Q4_K, MXFP4 = ggml.GGML_TYPE_Q8_0, ggml.GGML_TYPE_Q4_K, ggml.GGML_TYPE_MXFP4


@dataclass
class Weight:
    gtype: int
    shape: tuple[int, ...]  # GGUF order
    data: np.ndarray  # the bytes as ggml lays them (a float32 array for F32)


Build = Callable[[DeviceGraph, dict[str, Tensor], dict[str, Tensor]], Tensor]


def run(
    backend: Backend,
    weights: dict[str, Weight],
    inputs: dict[str, np.ndarray],
    build: Build,
    split: bool = False,
) -> np.ndarray:
    """Uploads `weights` to `backend`, builds the graph, sets `inputs` (F32 or I32 arrays), computes, reads back."""
    tensors = DeviceTensors(backend, len(weights))
    placed = {k: tensors.new(w.gtype, w.shape, k) for k, w in weights.items()}
    tensors.allocate()
    for k, w in weights.items():
        tensors.set(placed[k], w.data)
    g = DeviceGraph(backend, 256, split=split)
    ins = {k: g.input(F32 if a.dtype == np.float32 else I32, a.shape[::-1], k) for k, a in inputs.items()}
    out = build(g, placed, ins)
    g.finish(out)
    for k, a in inputs.items():
        g.set(ins[k], a)
    g.compute()
    result = g.get(out)
    g.close()
    tensors.close()
    return result


def quantized(rng: np.random.Generator, gtype: int, n_rows: int, n_per_row: int) -> tuple[Weight, np.ndarray]:
    """A random matrix in `gtype`, and the float values ggml computes with (for an exact reference)."""
    w = rng.standard_normal((n_rows, n_per_row)).astype(np.float32)
    if gtype == F32:
        return Weight(F32, (n_per_row, n_rows), w), w.astype(np.float64)
    raw = ggml_lib.quantize(w, gtype)
    exact = ggml_lib.dequantize(raw, gtype, n_rows, n_per_row).astype(np.float64)
    return Weight(gtype, (n_per_row, n_rows), raw), exact


def worst(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


@pytest.mark.parametrize("gtype", [F32, Q8_0, Q4_K, MXFP4], ids=["F32", "Q8_0", "Q4_K", "MXFP4"])
def test_mul_mat_matches_the_cpu_backend(gpu: Backend, cpu: Backend, gtype: int) -> None:
    rng = np.random.default_rng(1)
    k, n, m = 256, 32, 3  # K-quants need rows of 256
    weight, exact_w = quantized(rng, gtype, n, k)
    x = rng.standard_normal((m, k)).astype(np.float32)

    def build(g: DeviceGraph, w: dict[str, Tensor], i: dict[str, Tensor]) -> Tensor:
        return ggml.ggml_mul_mat(g.ctx, w["w"], i["x"])

    on_gpu = run(gpu, {"w": weight}, {"x": x}, build)
    on_cpu = run(cpu, {"w": weight}, {"x": x}, build)
    exact = x.astype(np.float64) @ exact_w.T
    assert on_gpu.shape == on_cpu.shape == (m, n)
    # The CPU backend quantizes activations (Q8_K/Q8_0) for quantized weights: ~1e-3; a device may do the same
    # (CUDA's q8_1) or compute in float (lavapipe: 1e-6). Either way no worse than 4× the CPU's own rounding.
    assert worst(on_gpu, exact) <= 4 * worst(on_cpu, exact) + 1e-5
    assert worst(on_gpu, on_cpu) < 3e-2  # lavapipe 7.5e-3 (Q4_K): the CPU side alone; CUDA adds its q8_1


def test_expert_pool_in_vram_filled_from_a_ram_pool(gpu: Backend, cpu: Backend) -> None:
    """ggml_mul_mat_id over a VRAM slot pool whose experts were copied in from a RAM slot pool (pinned where the
    device offers it), then one slot swapped for another expert and the same graph computed again."""
    rng = np.random.default_rng(2)
    k, n, n_expert, n_slots, n_used, n_tok = 256, 32, 6, 4, 2, 3
    experts = [quantized(rng, Q4_K, n, k)[0].data for _ in range(n_expert)]
    expert_bytes = experts[0].nbytes
    ram = HostBuffer(gpu, n_expert * expert_bytes)
    assert ram.address % 4096 == 0  # page-aligned: the streaming core's direct reads can land in it
    for e, raw in enumerate(experts):
        ram.array[e * expert_bytes : (e + 1) * expert_bytes] = raw
    ram_pool = ram.tensor(Q4_K, (k, n, n_expert), 0)

    vram = DeviceTensors(gpu, 1)
    pool = vram.new(Q4_K, (k, n, n_slots), "experts")
    vram.allocate()
    resident = [5, 2, 0, 3]  # slot -> expert
    for slot, e in enumerate(resident):
        vram.set_slot(pool, slot, ram.address + e * expert_bytes, wait=slot % 2 == 0)  # sync and queued copies
    gpu.synchronize()

    chosen = np.array([[2, 5], [0, 3], [5, 0]], np.int32)  # experts per token, all resident
    x = rng.standard_normal((n_tok, 1, k)).astype(np.float32)
    g = DeviceGraph(gpu, 64)
    xt = g.input(F32, (k, 1, n_tok))
    ids = g.input(I32, (n_used, n_tok))
    out = ggml.ggml_mul_mat_id(g.ctx, pool, xt, ids)
    g.finish(out)
    g.set(xt, x)

    def reference(expert_ids: np.ndarray) -> np.ndarray:
        c = DeviceGraph(cpu, 64)
        cx, cids = c.input(F32, (k, 1, n_tok)), c.input(I32, (n_used, n_tok))
        y = ggml.ggml_mul_mat_id(c.ctx, ram_pool, cx, cids)
        c.finish(y)
        c.set(cx, x)
        c.set(cids, expert_ids)
        c.compute()
        return c.get(y)

    slots = np.vectorize(resident.index)(chosen).astype(np.int32)
    g.set(ids, slots)
    g.compute()
    want = reference(chosen)
    assert g.get(out).shape == want.shape == (n_tok, n_used, n)
    assert worst(g.get(out), want) < 3e-2

    resident[1] = 1  # a swap: expert 1 replaces expert 2 in slot 1; the graph stays as it was built
    vram.set_slot(pool, 1, ram.address + 1 * expert_bytes)
    chosen = np.array([[1, 5], [0, 3], [1, 0]], np.int32)
    g.set(ids, np.vectorize(resident.index)(chosen).astype(np.int32))
    g.compute()
    assert worst(g.get(out), reference(chosen)) < 3e-2
    g.close()
    vram.close()
    ram.close()


def test_attention_block(gpu: Backend, cpu: Backend) -> None:
    """rms_norm, NEOX rope, a causal soft_max_ext with a mask and the two attention products, all in F32."""
    rng = np.random.default_rng(3)
    d, hd, n_head, t = 64, 16, 4, 5
    # weights of a trained model's scale (1/sqrt(d)): attention scores of order 1, not a near one-hot softmax whose
    # output moves 1000× more than the scores' last-bit differences
    wq, wk, wv = (Weight(F32, (d, d), rng.standard_normal((d, d)).astype(np.float32) / 8) for _ in range(3))
    norm = Weight(F32, (d,), (1 + 0.1 * rng.standard_normal(d)).astype(np.float32))
    x = rng.standard_normal((t, d)).astype(np.float32)
    pos = np.arange(7, 7 + t, dtype=np.int32)
    mask = np.triu(np.full((t, t), -np.inf, np.float32), 1)

    def build(g: DeviceGraph, w: dict[str, Tensor], i: dict[str, Tensor]) -> Tensor:
        c = g.ctx
        h = ggml.ggml_mul(c, ggml.ggml_rms_norm(c, i["x"], 1e-6), w["norm"])

        def heads(wt: Tensor, rope: bool) -> Tensor:
            y = ggml.ggml_reshape_3d(c, ggml.ggml_mul_mat(c, wt, h), hd, n_head, t)
            if rope:
                y = ggml.ggml_rope_ext(
                    c, y, i["pos"], None, hd, ggml_lib.ROPE_NEOX, 4096, 10000.0, 1.0, 0.0, 1.0, 0.0, 0.0
                )
            # contiguous: ggml-vulkan rounds a non-contiguous F32 operand of mul_mat to F16 (2e-4 here)
            return ggml.ggml_cont(c, ggml.ggml_permute(c, y, 0, 2, 1, 3))  # [hd, t, head]

        q, k, v = heads(w["wq"], True), heads(w["wk"], True), heads(w["wv"], False)
        kq = ggml.ggml_soft_max_ext(c, ggml.ggml_mul_mat(c, k, q), i["mask"], 1 / np.sqrt(hd), 0.0)
        vt = ggml.ggml_cont(c, ggml.ggml_transpose(c, v))  # [t, hd, head]
        return ggml.ggml_cont(c, ggml.ggml_permute(c, ggml.ggml_mul_mat(c, vt, kq), 0, 2, 1, 3))

    weights = {"wq": wq, "wk": wk, "wv": wv, "norm": norm}
    inputs = {"x": x, "pos": pos, "mask": mask}
    on_gpu, on_cpu = run(gpu, weights, inputs, build), run(cpu, weights, inputs, build)
    assert on_gpu.shape == (t, n_head, hd) and np.isfinite(on_gpu).all()
    assert worst(on_gpu, on_cpu) < 1e-5


def test_get_rows_and_top_k(gpu: Backend, cpu: Backend) -> None:
    """Token embeddings from a Q8_0 table on the device, and a router's top-k experts."""
    rng = np.random.default_rng(4)
    emb, _ = quantized(rng, Q8_0, 50, 64)
    tokens = np.array([3, 49, 0, 3], np.int32)

    def rows(g: DeviceGraph, w: dict[str, Tensor], i: dict[str, Tensor]) -> Tensor:
        return ggml.ggml_get_rows(g.ctx, w["emb"], i["tok"])

    got = run(gpu, {"emb": emb}, {"tok": tokens}, rows)
    assert np.array_equal(got, run(cpu, {"emb": emb}, {"tok": tokens}, rows))  # dequantization is exact
    assert got.shape == (4, 64) and np.array_equal(got[0], got[3])

    logits = rng.permutation(16 * 4).reshape(4, 16).astype(np.float32)  # distinct: no ties to order

    def top(g: DeviceGraph, w: dict[str, Tensor], i: dict[str, Tensor]) -> Tensor:
        return ggml.ggml_cont(g.ctx, ggml.ggml_argsort_top_k(g.ctx, i["logits"], 4))  # the top-k is a view

    ids = run(gpu, {}, {"logits": logits}, top)
    want = np.argsort(-logits, axis=1)[:, :4]
    assert np.array_equal(np.sort(ids, axis=1), np.sort(want, axis=1))
    assert np.array_equal(np.sort(run(cpu, {}, {"logits": logits}, top), axis=1), np.sort(want, axis=1))


def test_split_graph_gpu_and_cpu_experts(gpu: Backend) -> None:
    """One graph over the device and the CPU (ggml_backend_sched): a dense product on the device, then the
    selected experts computed where they live — VRAM slots on the device, RAM slots on the CPU — and summed.

    In a process of its own: on lavapipe (Mesa 22.3.6) this graph crashed with SIGSEGV in lavapipe's worker thread
    when it ran after the other tests of this file in one process (never alone: 40 runs in a row passed). Not
    understood yet; the GPU machine's run (bench/gpu_check.sh) shows whether a real driver does the same.
    """
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            f"from tests.compute.test_device_compute import split_case; split_case({gpu.device.name!r})",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr


def split_case(name: str) -> None:
    """The split graph's check, run by the test above in a child process."""
    gpu = Backend(device(name))
    cpu = Backend(next(d for d in list_devices() if d.kind == "cpu"))
    rng = np.random.default_rng(5)
    k, n, n_tok = 256, 32, 2
    dense, _ = quantized(rng, Q8_0, k, k)
    experts = [quantized(rng, Q4_K, n, k)[0].data for _ in range(4)]
    eb = experts[0].nbytes
    ram = HostBuffer(gpu, 4 * eb)
    for e, raw in enumerate(experts):
        ram.array[e * eb : (e + 1) * eb] = raw
    ram_pool = ram.tensor(Q4_K, (k, n, 4), 0)
    tensors = DeviceTensors(gpu, 2)
    dense_t = tensors.new(Q8_0, dense.shape)
    vram_pool = tensors.new(Q4_K, (k, n, 2))
    tensors.allocate()
    tensors.set(dense_t, dense.data)
    tensors.set_slot(vram_pool, 0, experts[2])
    tensors.set_slot(vram_pool, 1, experts[3])
    x = rng.standard_normal((n_tok, 1, k)).astype(np.float32)
    on_gpu_ids = np.array([[0], [1]], np.int32)  # token 0: expert 2 (slot 0), token 1: expert 3 (slot 1)
    on_cpu_ids = np.array([[0], [1]], np.int32)  # and experts 0 and 1 from RAM

    g = DeviceGraph(gpu, 64, split=True)
    xt = g.input(F32, (k, 1, n_tok))
    vid, cid = g.input(I32, (1, n_tok)), g.input(I32, (1, n_tok))
    h = ggml.ggml_mul_mat(g.ctx, dense_t, xt)
    on_device = ggml.ggml_mul_mat_id(g.ctx, vram_pool, h, vid)
    out = ggml.ggml_add(g.ctx, on_device, g.on_cpu(ggml.ggml_mul_mat_id(g.ctx, ram_pool, h, cid)))
    g.finish(out)
    assert g.n_splits >= 2  # the dense product and VRAM experts on the device, the RAM experts on the CPU
    g.set(xt, x)
    g.set(vid, on_gpu_ids)
    g.set(cid, on_cpu_ids)
    g.compute()
    got = g.get(out)

    def build(c: DeviceGraph, w: dict[str, Tensor], i: dict[str, Tensor]) -> Tensor:
        hh = ggml.ggml_mul_mat(c.ctx, w["dense"], i["x"])
        first = ggml.ggml_mul_mat_id(c.ctx, ram_pool, hh, i["vid"])
        return ggml.ggml_add(c.ctx, first, ggml.ggml_mul_mat_id(c.ctx, ram_pool, hh, i["cid"]))

    want = run(cpu, {"dense": dense}, {"x": x, "vid": on_gpu_ids + 2, "cid": on_cpu_ids}, build)
    assert got.shape == want.shape == (n_tok, 1, n)
    assert worst(got, want) < 3e-2
    g.close()
    tensors.close()
    ram.close()
    print("ok")


def test_a_graph_is_finished_once_and_computed_many_times(gpu: Backend) -> None:
    rng = np.random.default_rng(6)
    w, exact = quantized(rng, F32, 8, 32)
    tensors = DeviceTensors(gpu, 1)
    wt = tensors.new(F32, w.shape)
    tensors.allocate()
    tensors.set(wt, w.data)
    g = DeviceGraph(gpu, 16, split=True)
    x = g.input(F32, (32, 1))
    y = ggml.ggml_mul_mat(g.ctx, wt, x)
    g.finish(y)
    for seed in range(3):  # new inputs each time, no re-allocation
        xs = np.random.default_rng(seed).standard_normal((1, 32)).astype(np.float32)
        g.set(x, xs)
        g.compute()
        assert worst(g.get(y), xs @ exact.T) < 1e-5
    with pytest.raises(RuntimeError, match="892"):
        g.finish(y)
    g.close()
    tensors.close()


@pytest.mark.own_process  # (after the tests above in one process lavapipe crashed at this test's first graph: conftest)
def test_outputs_read_into_pinned_memory_behind_the_graph(gpu: Backend) -> None:
    """A decode step's outputs (a router's logits and its top-k) through `Readback`: queued on the device's stream
    after the graph, one wait, into pinned memory where the device has it; the same as reading each output."""
    rng = np.random.default_rng(7)
    w, exact = quantized(rng, F32, 16, 32)
    tensors = DeviceTensors(gpu, 1)
    wt = tensors.new(F32, w.shape)
    tensors.allocate()
    tensors.set(wt, w.data)
    g = DeviceGraph(gpu, 16)  # every node on the device
    x = g.input(F32, (32, 1))
    logits = ggml.ggml_mul_mat(g.ctx, wt, x)
    top = ggml.ggml_cont(g.ctx, ggml.ggml_argsort_top_k(g.ctx, logits, 4))
    g.finish(logits, top, check=True)
    reads = Readback(gpu)
    kept = []
    for seed in range(3):  # new inputs each time, the memory reused
        xs = np.random.default_rng(seed).standard_normal((1, 32)).astype(np.float32)
        g.set(x, xs)
        got, ids = g.compute_read(reads, [logits, top])
        assert worst(got.reshape(1, -1), xs @ exact.T) < 1e-5
        want = np.argsort(-(xs @ exact.T)[0])[:4]
        assert ids.dtype == np.int32 and sorted(ids.reshape(-1).tolist()) == sorted(want.tolist())
        assert np.array_equal(got, get_tensor(logits)) and np.array_equal(ids, get_tensor(top))
        kept.append((xs, got))
    assert reads.host is not None and reads.host.pinned == (gpu.host_buft is not None)
    for xs, got in kept:  # each read handed out its own arrays: later reads did not overwrite them
        assert worst(got.reshape(1, -1), xs @ exact.T) < 1e-5
    g.compute(wait=False)  # a read queued and abandoned (its caller failed) is dropped by the next one
    reads.queue([logits])
    big = DeviceGraph(gpu, 16)  # a larger read than the memory holds: it grows
    xb = big.input(F32, (32, 300))
    yb = ggml.ggml_mul_mat(big.ctx, wt, xb)
    big.finish(yb)
    xs = rng.standard_normal((300, 32)).astype(np.float32)
    big.set(xb, xs)
    (out,) = big.compute_read(reads, [yb])
    assert worst(out, xs @ exact.T) < 1e-5 and reads.host.nbytes >= out.nbytes
    with pytest.raises(RuntimeError, match="nothing queued"):
        reads.wait()
    reads.close()
    big.close()
    g.close()
    tensors.close()


def test_allocation_larger_than_the_device_fails_cleanly(gpu: Backend) -> None:
    tensors = DeviceTensors(gpu, 1)
    tensors.new(ggml.GGML_TYPE_I8, (gpu.device.total + (1 << 30),))
    with pytest.raises(DeviceMemoryError, match="could not allocate"):
        tensors.allocate()
    tensors.close()

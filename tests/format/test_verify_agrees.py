"""`tokenwing verify` says what the engine will say: its default check is what every start checks, so a file it
calls ok is one an engine start accepts. Fuzzed on the header region of a repacked model (byte flips in the
header and the resident tensors after it, overwritten length and count fields, truncations): `verify` and
`inspect` end with one line and an exit code, never a traceback, hang or signal."""

from __future__ import annotations

import json
import random
import struct
import subprocess
import sys
from pathlib import Path

from tests.conftest import ModelFactory, assert_clean_error, run_cli
from tokenwing.format.reader import ModelFile

ROOT = Path(__file__).resolve().parents[2]
CASES = 300
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def length_fields(data: bytes) -> list[tuple[int, int]]:
    """(offset, width) of every count and length in a GGUF header: tensor and key counts, key and string
    lengths, array counts, dimensions and their number, tensor offsets."""
    fields = [(8, 8), (16, 8)]
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    pos = 24

    def string() -> None:
        nonlocal pos
        fields.append((pos, 8))
        (n,) = struct.unpack_from("<Q", data, pos)
        pos += 8 + n

    for _ in range(n_kv):
        string()
        (vtype,) = struct.unpack_from("<I", data, pos)
        pos += 4
        if vtype == 8:
            string()
        elif vtype == 9:
            (itype,) = struct.unpack_from("<I", data, pos)
            fields.append((pos + 4, 8))
            (count,) = struct.unpack_from("<Q", data, pos + 4)
            pos += 12
            if itype == 8:
                for _ in range(count):
                    string()
            else:
                pos += _SIZES[itype] * count
        else:
            pos += _SIZES[vtype]
    for _ in range(n_tensors):
        string()
        fields.append((pos, 4))
        (n_dims,) = struct.unpack_from("<I", data, pos)
        pos += 4
        for _ in range(n_dims):
            fields.append((pos, 8))
            pos += 8
        pos += 4  # type
        fields.append((pos, 8))
        pos += 8
    return fields


def make_cases(data: bytes, data_start: int, resident_end: int, seed: int = 18) -> list[dict[str, object]]:
    """A third each: byte flips (half in the header, half in the resident tensors after it), a length field
    overwritten with an extreme or nearby value, a truncation inside the region or just past it."""
    rng = random.Random(seed)
    fields = length_fields(data)
    cases: list[dict[str, object]] = []
    for i in range(CASES):
        kind = i % 3
        if kind == 0:
            hi = data_start if rng.random() < 0.5 else resident_end
            lo = 0 if hi == data_start else data_start
            cases.append({"kind": "flip", "flip": sorted(rng.sample(range(lo, hi), rng.randint(1, 4)))})
        elif kind == 1:
            pos, width = rng.choice(fields)
            old = int.from_bytes(data[pos : pos + width], "little")
            top = (1 << (8 * width)) - 1
            value = rng.choice([0, 1, old + 1, max(old - 1, 0), top, top >> 1, 1 << 31, rng.randrange(top)]) & top
            cases.append({"kind": "length", "write": [(pos, list(value.to_bytes(width, "little")))]})
        else:
            cases.append({"kind": "cut", "cut": rng.randrange(0, resident_end + 4096)})
    return cases


def test_verify_ok_means_the_engine_starts(repacked_factory: ModelFactory, tmp_path: Path) -> None:
    model = repacked_factory(type="Q8_0", n_layer=3)
    data = model.read_bytes()
    with ModelFile.open(str(model)) as mf:
        data_start = mf.header.data_start
        resident_end = max(mf.tensor_offset(t) + t.nbytes for t in mf.resident)
    cases = make_cases(data, data_start, resident_end)
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.format.verify_fuzz_worker",
            str(model),
            str(tmp_path / "cases.json"),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        check=False,
    )
    results = [json.loads(line) for line in proc.stdout.splitlines()]
    nxt = cases[len(results)] if len(results) < len(cases) else None
    assert proc.returncode == 0 and len(results) == len(cases), (
        f"exit {proc.returncode} after {len(results)} cases (next: {nxt})\n{proc.stderr[-3000:]}"
    )
    ok = {kind: 0 for kind in ("flip", "length", "cut")}
    refused = dict(ok)
    for case, r in zip(cases, results, strict=True):
        for command in ("verify", "inspect"):
            code, err = r[command]["code"], r[command]["stderr"]
            assert code in (0, 2, 3, 4), (case, command, err)  # no traceback (None), no other exit
            if code != 0:
                lines = [ln for ln in err.splitlines() if ln.strip()]
                assert len(lines) == 1 and lines[0].startswith("tokenwing: error: "), (case, command, err)
        if r["verify"]["code"] == 0:
            ok[case["kind"]] += 1
            assert r["start"] == "ok", (case, r["start"])  # what verify accepts, a start accepts
        else:
            refused[case["kind"]] += 1
    # not vacuous: every kind of damage was refused, and some flips (in alignment padding) passed both
    assert all(refused.values()), refused
    assert ok["flip"] > 0 and ok["cut"] == 0, ok
    print(f"verify ok: {ok}, refused: {refused}")
    # the resident tensors are checked: flips in them are refused, and with the engine's own words
    tensor_flips = [
        r for c, r in zip(cases, results, strict=True) if c["kind"] == "flip" and min(c["flip"]) >= data_start
    ]
    assert any("fails its checksum" in r["verify"]["stderr"] for r in tensor_flips)


def test_real_cli_on_damaged_files(repacked_factory: ModelFactory, tmp_path: Path) -> None:
    """A few of the same damages through the real process: one line on stderr and the start's exit code."""
    model = repacked_factory(type="Q8_0", n_layer=3)
    data = bytearray(model.read_bytes())
    with ModelFile.open(str(model)) as mf:
        out = next(t for t in mf.resident if t.name == "output.weight")
        at = mf.tensor_offset(out) + out.nbytes // 2
    bad = tmp_path / "bad.tw.gguf"
    data[at] ^= 0xFF  # inside output.weight: the quick verify used to skip it while `run` refused the file
    bad.write_bytes(bytes(data))
    v = run_cli("verify", str(bad))
    assert_clean_error(v, 3)
    assert "tensor output.weight fails its checksum" in v.stderr
    r = run_cli("run", str(bad), "--prompt", "x", "-n", "1")
    assert_clean_error(r, 3)
    assert r.stderr == v.stderr  # the same words
    good = run_cli("verify", str(model))
    assert good.returncode == 0 and "what every start checks" in good.stdout
    for cut in (10, 100, len(data) // 2):
        bad.write_bytes(bytes(data[:cut]))
        for command in ("verify", "inspect"):
            assert_clean_error(run_cli(command, str(bad)))


def test_verify_and_a_start_check_the_same_experts(repacked_factory: ModelFactory, tmp_path: Path) -> None:
    """The sample of experts depends on the file alone: damage in a sampled expert stops both `verify` and a
    start, damage elsewhere neither (only `verify --full` sees it), never the one without the other."""
    from tokenwing.format import layout as L
    from tokenwing.format.reader import _sample

    model = repacked_factory(type="Q8_0", n_layer=3, n_expert=16)  # 48 experts: more than a sample
    with ModelFile.open(str(model)) as mf:
        ex = mf.index
        pairs = [(el.layer, e) for el in ex.layers for e in range(ex.n_expert)]
        sampled = set(_sample(pairs, ex, random.Random(int(mf.header.get(L.K_HEADER_CHECKSUM)))))
        assert 0 < len(sampled) < len(pairs)
        inside = next(p for p in pairs if p in sampled)
        outside = next(p for p in pairs if p not in sampled)
        at = {p: ex.layer(p[0]).expert_offset(p[1]) + 8 for p in (inside, outside)}
    for pair, refused in ((inside, True), (outside, False)):
        data = bytearray(model.read_bytes())
        data[at[pair]] ^= 0xFF
        bad = tmp_path / "bad.tw.gguf"
        bad.write_bytes(bytes(data))
        for _ in range(2):  # the same answer every time, not a fresh random sample
            v = run_cli("verify", str(bad))
            r = run_cli("run", str(bad), "--prompt", "x", "-n", "1", "--no-preload")
            assert (v.returncode, r.returncode) == ((3, 3) if refused else (0, 0)), (pair, v.stderr, r.stderr)
        assert_clean_error(run_cli("verify", "--full", str(bad)), 3)

"""The shared-memory addresses the CUDA kernels read their 128-byte swizzled tiles with (csrc/cuda/delta_rule/wgmma.cuh,
`sw128_off`), as the installed nvcc compiles them: kernels that store the address of every element pair the
kernels read (even columns, inside unrolled loops over column tiles, as the kernels write them) and of every row
ldmatrix reads (lda_sw128 and lda_t_sw128's pattern) are compiled to PTX, the PTX is evaluated here for every thread
of a warpgroup, and each address is compared with the layout's formula.

nvcc 13.0 has been seen to compile the same expression wrong at odd columns (the 16-byte chunk (c ^ (r & 7)) instead
of ((c >> 3) ^ (r & 7))), which is why the kernels address pairs only; this test keeps the form they rely on honest
for whichever nvcc builds the extension. Runs on the CPU; needs nvcc (skipped without)."""
import os
import re
import subprocess

import pytest

from helpers import find_nvcc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

KERNEL = r"""
// sw128_off as wgmma.cuh defines it (its two definitions, copied from the header by the test)
SW128_OFF
// thread t (a warpgroup): rows 16 warp + g8 + 8 hr; pairs at columns c0 + 8 nt + 2 q, nt over NT8 column tiles
template <int RT, int NT8>
__device__ __forceinline__ void pairs(int* out, int c0) {
  const int t = threadIdx.x, warp = t >> 5, lane = t & 31, g8 = lane >> 2, q = lane & 3;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr)
#pragma unroll
    for (int nt = 0; nt < NT8; ++nt)
      out[(t * 2 + hr) * NT8 + nt] = sw128_off<RT>(16 * warp + g8 + 8 * hr, c0 + 8 * nt + 2 * q);
}
// the row addresses of ldmatrix x4 as lda_sw128 / lda_t_sw128 form them, over unrolled 16 x 16 steps (m0, k0)
template <int RT, int TRANS>
__device__ __forceinline__ void ldsm_rows(int* out) {
  const int t = threadIdx.x, lane = t & 31, mi = lane >> 3;
#pragma unroll
  for (int m = 0; m < 4; ++m)
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int m0 = 16 * m, k0 = 16 * k;
      out[t * 32 + m * 8 + k] = TRANS ? sw128_off<RT>(k0 + (lane & 7) + (mi >> 1) * 8, m0 + (mi & 1) * 8)
                                      : sw128_off<RT>(m0 + (lane & 7) + (mi & 1) * 8, k0 + (mi >> 1) * 8);
    }
}
extern "C" __global__ void ldsm64(int* out) { ldsm_rows<64, 0>(out); }
extern "C" __global__ void ldsm128t(int* out) { ldsm_rows<128, 1>(out); }
extern "C" __global__ void rows64(int* out) { pairs<64, 8>(out, 0); }      // a 64 x 64 tile (A, DAE, R')
extern "C" __global__ void rows64w(int* out) { pairs<64, 16>(out, 0); }    // 64 rows, 128 columns (Q, K, V)
extern "C" __global__ void rows128(int* out) { pairs<128, 16>(out, 0); }   // 128 rows per block (hT, dS^T)
extern "C" __global__ void half64(int* out) { pairs<64, 8>(out, 64); }     // the second column block only
"""

# (RT, column tiles, first column) of each pair kernel above; (RT, transposed) of each ldmatrix kernel
CASES = {"rows64": (64, 8, 0), "rows64w": (64, 16, 0), "rows128": (128, 16, 0), "half64": (64, 8, 64)}
LDSM = {"ldsm64": (64, False), "ldsm128t": (128, True)}


def header_definitions():
    """The text of wgmma.cuh's two sw128_off definitions (the header itself pulls in c10's CUDA headers, which a
    CPU-only torch does not ship, so the test compiles the definitions alone)"""
    text = open(os.path.join(ROOT, "csrc", "cuda", "delta_rule", "wgmma.cuh")).read()
    plain = re.search(r"__device__ __forceinline__ int sw128_off\(int r, int c\) \{[^\n]*\}\n", text)
    templ = re.search(r"template <int RT> __device__ __forceinline__ int sw128_off\(int r, int c\) \{\n[^\n]*\n\}\n",
                      text)
    assert plain and templ, "wgmma.cuh's sw128_off definitions changed shape: update this test"
    return plain.group(0) + templ.group(0)


def sw128_off(rt, r, c):
    """the layout: 16-byte chunk (c mod 64) / 8 XOR (r mod 8) within row r of the c // 64-th block of rt rows"""
    c6 = c & 63
    return (c >> 6) * (rt * 128) + r * 128 + ((((c6 >> 3) ^ (r & 7)) << 4) | ((c6 & 7) * 2))


_OPS = {
    "and": lambda a, b: a & b, "or": lambda a, b: a | b, "xor": lambda a, b: a ^ b, "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b, "shl": lambda a, b: a << b, "mul": lambda a, b: a * b,
}


def eval_ptx(body, tid):
    """The global stores of a straight-line PTX entry body for thread `tid`: {byte offset from the parameter: value}.
    Covers what the kernels above compile to (integer and/or/xor/add/sub/shl/shr/mul/mad/bfi/mov/cvt, the
    parameter's address, st.global); any other instruction fails the test, so that an unevaluated step is never
    skipped."""
    regs, stores = {}, {}

    def val(x):
        x = x.strip()
        if x == "%tid.x":
            return tid
        if x in ("%tid.y", "%tid.z", "%ctaid.x", "%ctaid.y", "%ctaid.z"):
            return 0
        if x.startswith("%"):
            return regs[x]
        return int(x, 0)

    for raw in body.split("\n"):
        line = raw.split("//")[0].strip().rstrip(";").strip()
        if not line or line.startswith(".") or line in ("{", "}") or line == "ret":
            continue
        op, _, rest = line.partition(" ")
        args = [a.strip() for a in rest.split(",")]
        parts = op.split(".")
        base = parts[0]
        signed = any(p in ("s32", "s64") for p in parts)
        bits = 64 if any(p.endswith("64") for p in parts[1:]) or "wide" in parts else 32
        mask = (1 << bits) - 1

        def sx(v, b=32):
            v &= (1 << b) - 1
            return v - (1 << b) if signed and v >> (b - 1) else v

        if base == "ld" and "param" in parts:
            regs[args[0]] = 0
        elif base in ("cvta", "mov"):
            regs[args[0]] = val(args[1])
        elif base == "cvt":
            regs[args[0]] = sx(val(args[1]))
        elif base == "st" and "global" in parts:
            m = re.match(r"\[(%\w+)(?:\+(-?\d+))?\]", args[0])
            stores[val(m.group(1)) + int(m.group(2) or 0)] = val(args[1]) & 0xFFFFFFFF
        elif base == "shr":
            a = val(args[1]) & 0xFFFFFFFF
            regs[args[0]] = (sx(a) >> val(args[2])) & mask if signed else a >> val(args[2])
        elif base == "mul" and "wide" in parts:
            regs[args[0]] = (sx(val(args[1])) * sx(val(args[2]))) & ((1 << 64) - 1)
        elif base == "bfi":  # d = b with bits [pos, pos + len) taken from a's low bits
            pos, ln = val(args[3]), val(args[4])
            field = ((1 << ln) - 1) << pos
            regs[args[0]] = ((val(args[2]) & ~field) | ((val(args[1]) << pos) & field)) & mask
        elif base == "mad":
            regs[args[0]] = (val(args[1]) * val(args[2]) + val(args[3])) & mask
        elif base in _OPS:
            regs[args[0]] = _OPS[base](val(args[1]), val(args[2])) & mask
        else:
            raise AssertionError(f"PTX instruction outside the evaluated subset: {line}")
    return stores


def entry_bodies(ptx):
    out = {}
    for m in re.finditer(r"\.entry\s+(\w+)\s*\(", ptx):
        start = ptx.index("{", m.end())
        out[m.group(1)] = ptx[start:ptx.index("\n}", start)]
    return out


def test_tile_addresses_compile_to_the_layout(tmp_path):
    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found")
    src = tmp_path / "sw128_codegen.cu"
    src.write_text(KERNEL.replace("SW128_OFF", header_definitions()))
    ptx = tmp_path / "sw128_codegen.ptx"
    build = subprocess.run(
        [nvcc, "-std=c++17", "-O3", "--use_fast_math", "-gencode=arch=compute_90a,code=sm_90a", "-ptx",
         str(src), "-o", str(ptx)],
        capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-4000:]
    bodies = entry_bodies(ptx.read_text())
    assert set(bodies) == set(CASES) | set(LDSM), f"entries found: {sorted(bodies)}"
    wrong = []

    def check(name, got, key, rt, r, c):  # thread's store `key` holds the address of (r, c) in a tile of rt rows
        assert key in got, f"{name}: no address stored for row {r}, column {c}"
        if got[key] != sw128_off(rt, r, c):
            wrong.append(f"{name} (row {r}, column {c}): {got[key]} instead of {sw128_off(rt, r, c)}")

    for name, (rt, nt8, c0) in CASES.items():
        for t in range(128):
            warp, lane = t >> 5, t & 31
            g8, q = lane >> 2, lane & 3
            got = eval_ptx(bodies[name], t)
            for hr in range(2):
                for nt in range(nt8):
                    check(name, got, 4 * ((t * 2 + hr) * nt8 + nt), rt, 16 * warp + g8 + 8 * hr, c0 + 8 * nt + 2 * q)
    for name, (rt, trans) in LDSM.items():
        for t in range(128):
            lane = t & 31
            mi = lane >> 3
            got = eval_ptx(bodies[name], t)
            for m in range(4):
                for k in range(8):
                    m0, k0 = 16 * m, 16 * k
                    if trans:
                        r, c = k0 + (lane & 7) + (mi >> 1) * 8, m0 + (mi & 1) * 8
                    else:
                        r, c = m0 + (lane & 7) + (mi & 1) * 8, k0 + (mi >> 1) * 8
                    check(name, got, 4 * (t * 32 + m * 8 + k), rt, r, c)
    assert not wrong, f"{len(wrong)} addresses compiled wrong, e.g. " + "; ".join(wrong[:5])

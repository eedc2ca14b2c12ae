"""Compile every kernel variant for an NVIDIA GPU without one: ``python -m
harness.kernels.compile_check [--arch 90]`` prints one JSON line per variant.

The interpreter accepts things the GPU compiler refuses (``tl.dot`` shapes, dtype mixes),
so CPU-only CI runs this in a fresh process (TRITON_INTERPRET unset) to catch them. Triton
lowers to PTX and runs the ptxas it ships, no driver needed; the bundled cuobjdump then
reports registers and spill stack. Arguments get the alignment the JIT would infer at
real sizes (pointers and strides divisible by 16); without it loads are not vectorized and
the register counts mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any


def _variants() -> list[tuple[str, Any, dict[str, str], dict[str, Any]]]:
    from harness.kernels import decode, kivi, prefill, quest, scores, store

    def dec(dt: str, cache: str, out: str, **c: Any) -> tuple[dict[str, str], dict[str, Any]]:
        ptrs = {"q_ptr": dt, "k_ptr": cache, "v_ptr": cache, "ks_ptr": "fp32",
                "vs_ptr": "fp32", "table_ptr": "i64", "lens_ptr": "i64", "out_ptr": out,
                "lse_ptr": "fp32", "pos_ptr": "i64", "logit_ptr": "fp32",
                "lse_out_ptr": "fp32"}
        base = {"G": 4, "D": 128, "PAGE": 16, "BLOCK_H": 16, "BLOCK_D": 128, "BLOCK_N": 64,
                "HAS_WINDOW": False, "QUANT": False, "FP32_DOT": False, "SPLIT": False,
                "HAS_POS": False, "SCORES": False}
        return ptrs, {**base, **c}

    def pre(dt: str, cache: str, **c: Any) -> tuple[dict[str, str], dict[str, Any]]:
        ptrs = {"q_ptr": dt, "k_ptr": cache, "v_ptr": cache, "ks_ptr": "fp32",
                "vs_ptr": "fp32", "table_ptr": "i64", "cu_ptr": "i64", "start_ptr": "i64",
                "out_ptr": dt, "pos_ptr": "i64", "kvlen_ptr": "i64", "lse_ptr": "fp32"}
        base = {"G": 4, "D": 128, "PAGE": 16, "BLOCK_M": prefill.BLOCK_M, "BLOCK_D": 128,
                "BLOCK_N": prefill.BLOCK_N, "HAS_WINDOW": False, "QUANT": False,
                "FP32_DOT": False, "HAS_POS": False, "WRITE_LSE": False}
        return ptrs, {**base, **c}

    def sto(src: str, cache: str) -> dict[str, str]:
        return {"k_ptr": src, "v_ptr": src, "kc_ptr": cache, "vc_ptr": cache,
                "ks_ptr": "fp32", "vs_ptr": "fp32", "slot_ptr": "i64"}

    def qsel(dt: str) -> dict[str, str]:
        return {"q_ptr": dt, "kmin_ptr": dt, "kmax_ptr": dt, "table_ptr": "i64",
                "nblk_ptr": "i64", "lens_ptr": "i64", "bound_ptr": "fp32", "sel_ptr": "i64",
                "sel_lens_ptr": "i64"}

    def kiv(dt: str, out: str) -> dict[str, str]:
        return {"q_ptr": dt, "kq_ptr": "u8", "vq_ptr": "u8", "ks_ptr": "fp16", "kz_ptr": "fp16",
                "vs_ptr": "fp16", "vz_ptr": "fp16", "slab_ptr": "i64", "rk_ptr": dt,
                "rv_ptr": dt, "table_ptr": "i64", "lens_ptr": "i64", "out_ptr": out,
                "lse_ptr": "fp32"}

    def wts(dt: str) -> dict[str, str]:
        return {"q_ptr": dt, "k_ptr": dt, "pos_ptr": "i64", "table_ptr": "i64",
                "cu_ptr": "i64", "start_ptr": "i64", "kvlen_ptr": "i64", "rlo_ptr": "i64",
                "rhi_ptr": "i64", "klim_ptr": "i64", "lse_ptr": "fp32", "out_ptr": "fp32"}

    wconst = {"G": 4, "D": 128, "PAGE": 16, "BLOCK_M": scores.BLOCK_M,
              "BLOCK_N": scores.BLOCK_N, "BLOCK_D": 128, "PER_HEAD": False, "FP32_DOT": False}
    kconst = {"G": 4, "D": 128, "PAGE": 16, "BLOCK_H": 16, "BLOCK_D": 128,
              "BLOCK_N": decode.BLOCK_N, "FP32_DOT": False, "SPLIT": False}
    sizes = {"KV": 8, "D": 128, "BLOCK_T": 2, "BLOCK_KV": 8, "BLOCK_D": 128}
    return [
        ("decode-bf16", decode._decode_kernel, *dec("bf16", "bf16", "bf16")),
        ("decode-bf16-split-window", decode._decode_kernel,
         *dec("bf16", "bf16", "fp32", SPLIT=True, HAS_WINDOW=True)),
        ("decode-bf16-fp8", decode._decode_kernel,
         *dec("bf16", "fp8e4nv", "bf16", QUANT=True)),
        ("decode-fp16-int8-mha", decode._decode_kernel,
         *dec("fp16", "i8", "fp32", G=1, QUANT=True, SPLIT=True)),
        ("decode-fp32", decode._decode_kernel,
         *dec("fp32", "fp32", "fp32", G=8, D=64, BLOCK_D=64, PAGE=8, FP32_DOT=True)),
        # The token-evicting methods' decode: slot lists, logits for the scores (split).
        ("decode-bf16-slots-scores", decode._decode_kernel,
         *dec("bf16", "bf16", "bf16", HAS_POS=True, SCORES=True)),
        ("decode-bf16-slots-scores-split", decode._decode_kernel,
         *dec("bf16", "bf16", "fp32", HAS_POS=True, SCORES=True, SPLIT=True)),
        ("combine", decode._combine_kernel,
         {"part_ptr": "fp32", "lse_ptr": "fp32", "out_ptr": "bf16", "lse_out_ptr": "fp32"},
         {"D": 128, "BLOCK_S": 16, "BLOCK_D": 128, "WRITE_LSE": False}),
        ("combine-lse", decode._combine_kernel,
         {"part_ptr": "fp32", "lse_ptr": "fp32", "out_ptr": "bf16", "lse_out_ptr": "fp32"},
         {"D": 128, "BLOCK_S": 16, "BLOCK_D": 128, "WRITE_LSE": True}),
        ("prefill-bf16", prefill._prefill_kernel, *pre("bf16", "bf16")),
        ("prefill-bf16-slots-lse", prefill._prefill_kernel,
         *pre("bf16", "bf16", HAS_POS=True, WRITE_LSE=True, BLOCK_M=prefill.BLOCK_M_SLOTS)),
        ("scores-decode", scores._decode_weights_kernel,
         {"logit_ptr": "fp32", "lse_ptr": "fp32", "table_ptr": "i64", "lens_ptr": "i64",
          "pos_ptr": "i64", "out_ptr": "fp32"},
         {"H": 32, "PAGE": 16, "BLOCK_H": 32, "BLOCK_N": scores.BLOCK_N}),
        ("scores-prefill-bf16", scores._prefill_weights_kernel, wts("bf16"), wconst),
        ("scores-prefill-bf16-per-head-odd", scores._prefill_weights_kernel, wts("bf16"),
         {**wconst, "G": 3, "D": 80, "PAGE": 24, "PER_HEAD": True}),
        ("prefill-bf16-fp8-window-odd", prefill._prefill_kernel,
         *pre("bf16", "fp8e4nv", G=3, D=80, PAGE=24, QUANT=True, HAS_WINDOW=True)),
        ("quest-select-bf16", quest._quest_select_kernel, qsel("bf16"),
         {"G": 4, "D": 128, "PAGE": 16, "BLOCK_D": 128, "BLOCK_W": quest.BLOCK_W}),
        ("quest-select-fp32-odd", quest._quest_select_kernel, qsel("fp32"),
         {"G": 3, "D": 80, "PAGE": 24, "BLOCK_D": 128, "BLOCK_W": quest.BLOCK_W}),
        ("kivi-decode-bf16-2bit", kivi._kivi_decode_kernel, kiv("bf16", "bf16"),
         {**kconst, "BITS": 2}),
        ("kivi-decode-bf16-4bit-split", kivi._kivi_decode_kernel, kiv("bf16", "fp32"),
         {**kconst, "BITS": 4, "SPLIT": True}),
        ("kivi-decode-bf16-2bit-odd", kivi._kivi_decode_kernel, kiv("bf16", "bf16"),
         {**kconst, "G": 3, "D": 80, "PAGE": 24, "BITS": 2}),
        ("kivi-decode-fp16-4bit-mha", kivi._kivi_decode_kernel, kiv("fp16", "fp32"),
         {**kconst, "G": 1, "BITS": 4, "SPLIT": True}),
        # (A float32 cache compiles but spills: 0.5-2.4 KB of stack at head_dim 64-128,
        # the float32 dot's operands beside the dequantized tiles; models run 16-bit on a
        # GPU, so it is not a variant here.)
        ("store-bf16", store._store_kv_kernel, sto("bf16", "bf16"), sizes),
        ("store-fp8", store._store_kv_quant_kernel, sto("bf16", "fp8e4nv"),
         {**sizes, "QMAX": 448.0, "IS_INT8": False}),
        ("store-int8", store._store_kv_quant_kernel, sto("fp16", "i8"),
         {**sizes, "QMAX": 127.0, "IS_INT8": True}),
    ]


def _resources(cubin: bytes, cuobjdump: Path) -> dict[str, int]:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(cuobjdump), "--dump-resource-usage", f.name],
                              capture_output=True, text=True, check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", text)
    assert found, text
    return {"registers": int(found[1]), "stack_bytes": int(found[2])}


def check(arch: int = 90, only: str = "") -> list[dict[str, Any]]:
    """Compile each variant (name containing ``only``) for sm_``arch``; a failure is a row
    with ``error``, not an exception."""
    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "run without the interpreter"
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    target = GPUTarget("cuda", arch, 32)
    rows: list[dict[str, Any]] = []
    for name, fn, ptrs, consts in _variants():
        if only not in name:
            continue
        sig = {a: ("constexpr" if a in consts else f"*{ptrs[a]}" if a in ptrs
                   else "fp32" if a in ("qk_scale", "coef") else "i32") for a in fn.arg_names}
        aligned = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
                   if a.endswith("_ptr") or a.startswith("stride_")}
        try:
            k = triton.compile(ASTSource(fn, sig, consts, aligned), target=target,
                               options={"num_warps": 4})
            row: dict[str, Any] = {"variant": name, **_resources(k.asm["cubin"], cuobjdump)}
        except Exception as e:  # a variant that fails to compile is the finding
            row = {"variant": name, "error": f"{type(e).__name__}: {e}"[:2000]}
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="compile the kernels for sm_ARCH, no GPU")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--only", default="", help="variants whose name contains this")
    args = ap.parse_args(argv)
    rows = check(args.arch, args.only)
    for r in rows:
        print(json.dumps(r))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

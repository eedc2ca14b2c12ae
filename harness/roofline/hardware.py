"""Hardware specs for the roofline executor: peaks, efficiencies, overheads, memory.

Peaks are the vendors' dense figures (no sparsity), per device, and bandwidths the
datasheets'; memory is what CUDA reports for that card (less than the datasheet's "80 GB":
the driver keeps some), each with its source in ``HardwareSpec.cited``. None is fitted.
Efficiencies are the
share of a peak a kernel reaches: priors for the GPUs (typical of large GEMMs and of
streaming kernels on them), Vidur-fitted for ``h100-sxm`` and the A100s (the ``h200``,
the same GH100 die with more memory, takes the H100's with a measured copy share of
~4.3 TB/s of 4.8), and measured and fitted for ``cpu``:
``python -m harness.roofline_tools.calibrate`` writes harness/roofline/cpu_calibration.json,
read here. A CPU's GEMM speed depends on the row count in ways no roofline captures (one
row is a GEMV that streams the weights; a row count off the kernel's 4-row tiles costs a
partial pass), so the cpu spec carries a GEMM profile as Vidur carries its profiling
tables: seconds per weight parameter at each row count, measured on the model's own
shapes, interpolated between them.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.errors import UserError

TB, GB, GiB = 1e12, 1e9, 2**30
CALIBRATION = Path(__file__).resolve().parent / "cpu_calibration.json"
ATTENTION = ("fused", "gather")


@dataclass(frozen=True)
class HardwareSpec:
    name: str
    peak_flops: dict[str, float]  # dense FLOP/s per compute dtype
    mem_bw: float  # bytes/s of device memory
    mem_bytes: int  # capacity of one device
    eff_gemm: float = 0.7  # share of peak FLOP/s a weight GEMM reaches
    eff_attn: float = 0.5  # share of peak FLOP/s attention reaches
    eff_bw: float = 0.8  # share of mem_bw a streaming read reaches (weights, K/V)
    # How far compute and memory traffic overlap: 1 = a GPU's roofline, max(compute,
    # memory); 0 = their sum, as on a CPU core that streams weights between its FMAs.
    overlap: float = 1.0
    step_overhead_s: float = 1e-3  # fixed per step: scheduling, launch, sampling
    per_seq_overhead_s: float = 5e-6  # per running sequence per step (host bookkeeping)
    link_bw: float = 0.0  # bytes/s one way between tensor-parallel ranks
    link_latency_s: float = 10e-6  # per all-reduce
    host_bw: float = 50e9  # bytes/s between device and host (swaps): PCIe gen5 x16
    activation_reserve_bytes: int = 2 * 2**30  # per device, kept out of the KV budget
    # How attention runs (harness.roofline.shape): "fused" kernels read K/V in place;
    # "gather" is the torch reference path (padded decode batch, masked prefill pairs).
    attention: str = "fused"
    # Measured GEMM time: (rows, seconds per decoder-layer weight parameter, seconds per
    # lm_head parameter) rows ascending, for `profile_dtype`; empty = the roofline.
    gemm_profile: tuple[tuple[float, float, float], ...] = ()
    profile_dtype: str = ""
    eff_profile: float = 1.0  # share of the profiled GEMM speed a real step's GEMMs reach
    # Measured seconds per element to widen a stored 1-byte dtype ("int8", "fp8") to the
    # compute dtype on the gather path: its compute, beyond the bytes it moves.
    widen_s_per_elem: dict[str, float] = field(default_factory=dict)
    # Kernel-level terms fitted to Vidur's profiled kernels (harness.roofline_tools.kernel_fit;
    # 0 = off, as on the calibrated cpu spec, whose eff_profile absorbs them):
    gemm_corner_p: float = 0.0  # GEMM time (c^p + m^p)^(1/p): the roofline's rounded corner
    gemm_kernel_s: float = 0.0  # fixed cost per GEMM kernel (4 a layer + the lm_head)
    nongemm_kernel_s: float = 0.0  # per non-GEMM kernel (norms, RoPE, SiLU-and-mul, adds)
    eff_elem: float = 0.0  # share of mem_bw the non-GEMM kernels stream at (0: no term)
    # The all-reduce's small-message time by tensor-parallel degree (else link_latency_s).
    allreduce_latency_s: dict[int, float] = field(default_factory=dict)
    # Share of a dtype's peak its large weight GEMMs reach, where it differs from
    # eff_gemm (fitted to that dtype's kernel profile: fp8 on Hopper, kernel_fit --fp8).
    eff_gemm_dtype: dict[str, float] = field(default_factory=dict)
    # MoE expert GEMMs by kernel kind ("bf16", "fp8", "fp8_block"): (a fixed time per MoE
    # layer, ((lower edge of tokens per busy expert, share of the datasheet roofline),
    # ...)), fitted to fused / grouped MoE kernel tables (kernel_fit --moe); empty = the
    # dense GEMM shares (steptime.StepModel._expert_s).
    moe_profile: dict[str, tuple[float, tuple[tuple[float, float], ...]]] = \
        field(default_factory=dict)
    source: str = "prior"  # prior | fitted | measured | calibrated (the record says which)
    # Where each physical quantity comes from ("peaks", "mem_bw", "mem_bytes"): datasheets
    # for peaks and bandwidth, what CUDA reports for memory; never a fit.
    cited: dict[str, str] = field(default_factory=dict)
    extra: dict[str, float] = field(default_factory=dict)

    def allreduce_latency(self, tp: int) -> float:
        """Seconds of one all-reduce of a small message over ``tp`` ranks: the profiled
        figure at ``tp``, else at the nearest profiled degree, else ``link_latency_s``."""
        lat = self.allreduce_latency_s
        if not lat:
            return self.link_latency_s
        return lat[min(lat, key=lambda k: (abs(k - tp), k))]

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION:
            raise UserError(f"hardware {self.name}: attention must be one of "
                            f"{', '.join(ATTENTION)}, got {self.attention!r}")

    def profiled(self, dtype: str) -> bool:
        """Whether GEMMs in ``dtype`` are timed by the profile (else by the roofline)."""
        return bool(self.gemm_profile) and dtype_key(dtype) == dtype_key(self.profile_dtype)

    def gemm_eff(self, dtype: str, block_scaled: bool = False) -> float:
        """Share of ``dtype``'s peak FLOP/s a large weight GEMM reaches on this spec
        (``block_scaled``: fp8 with block-wise scales, where the spec knows its share)."""
        key = dtype_key(dtype)
        if block_scaled and f"{key}_block" in self.eff_gemm_dtype:
            return self.eff_gemm_dtype[f"{key}_block"]
        return self.eff_gemm_dtype.get(key, self.eff_gemm)

    def moe_kernels(self, kind: str) -> tuple[float, tuple[tuple[float, float], ...]] | None:
        """The MoE kernel profile of ``kind`` (HardwareSpec.moe_profile), None where the
        spec has none. Weight-only kinds ("w4a16": MXFP4 / NVFP4 / int4 weights, "w8a16":
        int8, each dequantized to bf16 in the kernel) take the bf16 kernels' profile,
        a prior: no published table times them."""
        prof = self.moe_profile
        if kind in prof:
            return prof[kind]
        if kind in ("w4a16", "w8a16", "fp16"):
            return prof.get("bf16")
        return None

    def flops(self, dtype: str) -> float:
        key = dtype_key(dtype)
        if key not in self.peak_flops:
            why = (" (FP4 tensor cores are Blackwell's: roofline.hardware=b200; here, "
                   "mxfp4 / nvfp4 weights run weight-only with roofline.compute_dtype=auto)"
                   if key == "fp4" else "")
            raise UserError(f"roofline.hardware={self.name} has no peak for dtype {dtype!r}"
                            f"{why}; it has {', '.join(self.peak_flops)}")
        return self.peak_flops[key]


def dtype_key(dtype: str) -> str:
    """A dtype's short name ("bfloat16" -> "bf16", "half" -> "fp16", ...), the key of
    peak_flops, eff_gemm_dtype and moe_profile; other names as they are."""
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16",
            "half": "fp16"}.get(dtype, dtype)


def _gpu(name: str, bf16: float, fp8: float, int8: float, fp32: float, bw: float,
         mem_bytes: int, link: float, fp4: float = 0.0, **kw: Any) -> HardwareSpec:
    """A GPU spec: dense peaks in TFLOP/s (TOPS for int8; ``fp4``: FP4 tensor cores,
    Blackwell's, 0 = none), bandwidth in TB/s, memory in bytes as CUDA reports it
    (``torch.cuda.mem_get_info`` / ``total_memory``: what vLLM's
    ``gpu_memory_utilization`` and TensorRT-LLM's free fraction are shares of)."""
    peaks = {"bf16": bf16 * TB, "fp16": bf16 * TB, "fp8": fp8 * TB, "int8": int8 * TB,
             "fp32": fp32 * TB}
    if fp4:
        peaks["fp4"] = fp4 * TB
    return HardwareSpec(name, peaks, bw * TB, mem_bytes, link_bw=link * GB, **kw)


# The CPU's priors before calibration: one core of this machine (AVX2 FMA, fp32), whose
# peak, bandwidth and GEMM profile `calibrate` measures and whose factors it fits; the
# figures mean "this machine, one thread", nothing more. Nothing overlaps on one core.
CPU_PRIOR = HardwareSpec("cpu", {"fp32": 80e9, "bf16": 10e9}, 20e9, 24 * GiB,
                         eff_gemm=0.5, eff_attn=0.2, eff_bw=0.5, overlap=0.0,
                         step_overhead_s=1e-3, per_seq_overhead_s=10e-6,
                         activation_reserve_bytes=1 * GiB, attention="gather")

# Kernel constants fitted by `python -m harness.roofline_tools.kernel_fit` to Vidur's
# profiled kernels (harness/roofline_tools/data/vidur; tests/roofline/test_whatif_validate.py checks
# they are the fit's optimum): the GEMMs' shares of peak FLOP/s and of bandwidth, the
# rounded roofline corner, the fixed cost per GEMM and per non-GEMM kernel, the non-GEMM
# kernels' bandwidth share, and NCCL's all-reduce (small-message time per degree; bus
# bandwidth of 8-64 MiB ones).
H100_KERNELS: dict[str, Any] = dict(
    eff_gemm=0.70, eff_bw=0.90, gemm_corner_p=1.5, gemm_kernel_s=6e-6,
    nongemm_kernel_s=1.9e-6, eff_elem=0.60, allreduce_latency_s={2: 39e-6, 4: 42e-6, 8: 32e-6})
A100_KERNELS: dict[str, Any] = dict(
    eff_gemm=0.71, eff_bw=0.81, gemm_corner_p=1.5, gemm_kernel_s=6e-6,
    nongemm_kernel_s=2.05e-6, eff_elem=0.54, allreduce_latency_s={2: 54e-6, 4: 42e-6, 8: 40e-6})

# Memory as CUDA reports it (the device's memory less what the driver and ECC keep), by
# card, from a CUDA message or deviceQuery on that card; nvidia-smi shows a little more
# (modal-labs/modal-client#2797: H100 81559 MiB, A100-80GB 81920, A100-40GB 40960, L40S
# 46068), the datasheet's "80 GB" / "141 GB" more still. 79.11 GiB x 2^30 = 84.94e9 bytes.
CUDA_MEM: dict[str, tuple[int, str]] = {
    "h100-sxm": (int(79.11 * GiB), "79.11 GiB: 'GPU 0 has a total capacity of 79.11 GiB', "
                 "torch OOM message on an H100 80GB (vllm-project/vllm#27508, 2025)"),
    "h200": (int(139.8 * GiB), "139.8 GiB: torch total_memory on the lent H200 "
             "(results/gpu/2026-12-04-run1/env.json)"),
    "a100-80gb": (int(79.25 * GiB), "79.25 GiB: '79.25 GiB total capacity', torch OOM "
                  "message on an A100 80GB (levihsu/OOTDiffusion#235, 2025)"),
    "a100-40gb": (42298834944, "40339 MiB (42298834944 bytes): deviceQuery on an "
                  "A100-SXM4-40GB (bottlerocket-os/bottlerocket#3873, 2024)"),
    "l40s": (int(44.42 * GiB), "44.42 GiB: 'GPU has a total capacity of 44.42 GiB', torch "
             "OOM message on an L40S (stepfun-ai/Step-Video-T2V#8, 2025)"),
    "b200": (int(178.35 * GiB), "178.35 GiB: cudaDeviceProp totalGlobalMem on a B200 "
             "(pytorch/ao#4002, 2026-03-05)"),
}
H100_DATASHEET = ("NVIDIA H100 Tensor Core GPU datasheet, SXM5 column: 1,979 TFLOPS bf16 / "
                  "3,958 fp8 / 3,958 TOPS int8 with sparsity (halved: dense), 67 TFLOPS "
                  "fp32, 3.35 TB/s HBM3")
A100_DATASHEET = ("NVIDIA A100 Tensor Core GPU datasheet: 312 TFLOPS bf16 and 624 TOPS int8 "
                  "dense, 19.5 TFLOPS fp32; 2,039 GB/s (80GB SXM), 1,555 GB/s (40GB); no "
                  "fp8 units (fp8 runs as bf16)")


def _cited(name: str, sheet: str) -> dict[str, Any]:
    """``mem_bytes`` as CUDA reports it and the sources of a GPU's physics."""
    mem, why = CUDA_MEM[name]
    return {"mem_bytes": mem, "cited": {"peaks": sheet, "mem_bw": sheet, "mem_bytes": why}}


# FP8 GEMMs on Hopper, by how their scales are laid out (`python -m
# harness.roofline_tools.kernel_fit --fp8`): per-tensor / per-row scales (Llama-class FP8
# checkpoints) run 1.92x bf16 on one H100 (FBGEMM's table, harness/roofline_tools/data/
# fbgemm): 0.67 of the fp8 peak; block-wise scales (DeepSeek-V3's format) 0.50, fitted to
# DeepSeek's published H800 table (its CUTLASS baseline; data/deepgemm), 0.52 by FBGEMM's
# block-wise ratio.
HOPPER_FP8 = {"fp8": 0.67, "fp8_block": 0.50}

# The B200's GEMM constants (`python -m harness.roofline_tools.kernel_fit --b200`; tests/
# roofline/test_b200_kernels.py re-fits and checks), fitted by the H100's rules at the
# b200 spec's datasheet peaks to published B200 kernel tables (harness/roofline_tools/
# data/vllm_b200: vLLM's GEMM benchmarks on one B200 at Llama-3.1-8B's layer shapes,
# 1-16384 tokens, 2025-05..07): bf16 (torch / cuBLAS; 24 rows, 3 shapes) reaches 0.64 of
# its peak (the H100's 0.70), its weights stream at 0.80 of the 7.67 TB/s (0.90), the
# corner is rounder (p 3.0, 1.5) and a kernel costs 2 us (6 us): median error 4.9%, worst
# 39.1% (cuBLAS's 4096 x 4096 GEMV at 1 token: 12.3 us). No B200 table times the
# non-GEMM kernels or NCCL's all-reduce: those stay the H100's, a prior.
BLACKWELL_KERNELS: dict[str, Any] = dict(
    H100_KERNELS, eff_gemm=0.64, eff_bw=0.80, gemm_corner_p=3.0, gemm_kernel_s=2e-6)
# Low-precision GEMMs on the B200, each the share of its own peak that fits (same fit):
# fp8 per-channel / per-token (vLLM's CUTLASS, tuned for SM100 in vLLM #18778 / #19566;
# 13 rows to 1024 tokens: median 6.3%, worst 17.6%) 0.54. NVFP4 0.42 (the bf16 share,
# 0.64, was its prior until 2026-12-05's eighth session), from the kernels engines run
# now: FlashInfer's CUTLASS mm_fp4 (TensorRT-LLM's kernel; #1979 at 1024 x 7168 x 4608,
# #1732 at one token) and SGLang's JIT CUTLASS (#22091, 12 shapes of 512-18144 tokens);
# 14 rows, median 38.9%, worst 60.5%: one share fits them badly, NVFP4 reaching 0.49-0.67
# of its peak at 18144 tokens and 0.17-0.27 at 512-4608 tokens on small matrices (its
# one-token GEMV streams at 0.23 of the bandwidth where the bf16 share is 0.80). vLLM's
# table timed before its SM100 tuning (#20578; #20646's "Before") fits 0.36 (11 rows:
# median 21.6%, worst 62.0%), kept apart. Block-wise fp8 is timed by no B200 table:
# Hopper's share, a prior.
BLACKWELL_GEMM = {"fp8": 0.54, "fp8_block": HOPPER_FP8["fp8_block"], "fp4": 0.42}
B200_FP4_UNTUNED = 0.36  # kernel_fit --b200's fit of the untuned NVFP4 table (not used)

# MoE expert GEMMs (`python -m harness.roofline_tools.kernel_fit --moe`, from harness/
# roofline_tools/data/moe and data/deepgemm/grouped_gemm_h800.csv; tests/roofline/
# test_moe_kernels.py re-fits and checks): t = t0 per MoE layer + the expert GEMMs'
# roofline at the datasheet peaks / share, the share by the mean tokens per busy expert
# (no share above the dense GEMMs' bandwidth share: 0.90 Hopper, 0.81 Ampere). Hopper:
# bf16 from vLLM's Triton fused_moe on Mixtral-8x7B's TP2 shapes (H100, tuned configs;
# 15 rows, median error 1.4%, worst 10.8%); fp8 per-tensor from vLLM's on Qwen3-30B-A3B
# (H100, default configs) and SGLang's on Qwen3-235B's TP8 shapes (H200, untuned; 25
# rows, 5.4% / 51.4%); fp8 block-wise from vLLM's on DeepSeek-R1's and Qwen3-Next's TP2
# shapes (H200) and DeepGEMM's grouped table's CUTLASS baseline (H800, one GEMM a row: no
# t0; 19 rows, 7.4% / 18.7%), its buckets of 2-256 tokens per expert without rows (their
# nearest bucket's share: a gap). Ampere: bf16 from vLLM's on Moonlight-16B-A3B's shapes
# (one A100-SXM4-80GB, default configs; 7 rows, 9.7% / 18.2%; one shape: t0 and the
# shares trade off, the cap binds).
HOPPER_MOE: dict[str, tuple[float, tuple[tuple[float, float], ...]]] = {
    "bf16": (18.5e-6, ((1, 0.86), (2, 0.90), (4, 0.90), (16, 0.89), (64, 0.73), (256, 0.51))),
    "fp8": (28e-6, ((1, 0.68), (2, 0.70), (4, 0.74), (16, 0.52), (64, 0.23), (256, 0.11))),
    "fp8_block": (27e-6, ((1, 0.80), (2, 0.80), (4, 0.80), (16, 0.46), (64, 0.46),
                          (256, 0.46))),
}
AMPERE_MOE: dict[str, tuple[float, tuple[tuple[float, float], ...]]] = {
    "bf16": (96.5e-6, ((1, 0.81), (2, 0.81), (4, 0.81), (16, 0.81), (64, 0.59), (256, 0.48))),
}

HARDWARE: dict[str, HardwareSpec] = {h.name: h for h in (
    # H100 SXM5; NCCL all-reduce bus bandwidth 340 GB/s (Vidur, h100_dgx) of NVLink's 450
    # one way.
    _gpu("h100-sxm", 989, 1979, 1979, 67, 3.35, link=340, **H100_KERNELS,
         eff_gemm_dtype=HOPPER_FP8, moe_profile=HOPPER_MOE, source="fitted",
         **_cited("h100-sxm", H100_DATASHEET)),
    # H200: the H100's GH100 die, clocks and NVLink, 4.8 TB/s HBM3e. Vidur profiles
    # no H200: the H100's kernel constants, GEMM share included, and a measured copy share
    # (~4.3 TB/s = 0.90 of 4.8). One bf16 micro-benchmark's GEMM share (~790 TFLOP/s, 0.80)
    # was the prior until 2026-12-03: TensorRT-LLM v1.0's H200 rows (calibration.yaml,
    # trtllm-perf-overview-v1.0-h200) came out +5% to +18% with it, +2% to +10% with 0.70.
    _gpu("h200", 989, 1979, 1979, 67, 4.8, link=340, **H100_KERNELS,
         eff_gemm_dtype=HOPPER_FP8, moe_profile=HOPPER_MOE, source="measured",
         **_cited("h200", "NVIDIA H200 Tensor Core GPU datasheet (SXM): 1,979 TFLOPS bf16 / "
                  "3,958 fp8 / 3,958 TOPS int8 with sparsity (halved: dense), 67 TFLOPS "
                  "fp32, 4.8 TB/s HBM3e")),
    # A100: NCCL bus bandwidth 190 GB/s (a100_dgx).
    _gpu("a100-80gb", 312, 312, 624, 19.5, 2.039, link=190, **A100_KERNELS, source="fitted",
         moe_profile=AMPERE_MOE, **_cited("a100-80gb", A100_DATASHEET)),
    _gpu("a100-40gb", 312, 312, 624, 19.5, 1.555, link=190, **A100_KERNELS, source="fitted",
         moe_profile=AMPERE_MOE, **_cited("a100-40gb", A100_DATASHEET)),
    # PCIe gen4 x16 between cards; an unfitted prior (no kernel profile of the L40S), its
    # fp8 share taken from Hopper's.
    _gpu("l40s", 362, 733, 733, 91.6, 0.864, link=32, eff_gemm_dtype=HOPPER_FP8,
         **_cited("l40s", "NVIDIA L40S datasheet: 362.05 TFLOPS bf16, 733 fp8, 733 TOPS "
                  "int8 (dense: half the sparsity figures), 91.6 TFLOPS fp32, 864 GB/s "
                  "GDDR6")),
    # B200 (HGX, 1000 W): GEMMs fitted to published B200 kernel tables (BLACKWELL_KERNELS,
    # BLACKWELL_GEMM); the non-GEMM kernels, the all-reduce's latency and block-wise fp8
    # are the H100's (a prior), and MoE experts take the dense shares (no B200 MoE table).
    # NVLink 5 is 900 GB/s one way; NCCL's bus bandwidth taken at the H100's share of its
    # link (340 of 450), a prior. HBM3e bandwidth from the bus width CUDA reports (7,680
    # bits) and the memory clock (3,996 MHz, double data rate): 7.67 TB/s, not the 8 TB/s
    # once published.
    _gpu("b200", 2250, 4500, 4500, 80, 7.672, link=680, fp4=9000, **BLACKWELL_KERNELS,
         eff_gemm_dtype=BLACKWELL_GEMM, source="fitted",
         **_cited("b200", "NVIDIA HGX B200 datasheet, per GPU, dense (half the sparsity "
                  "figures): 2.25 PFLOPS bf16, 4.5 fp8, 4.5 POPS int8, 9 PFLOPS fp4, 80 "
                  "TFLOPS fp32 (as torchao's roofline_utils carries them); 7.67 TB/s HBM3e "
                  "from the device query in pytorch/ao#4002")),
)}


def calibration_path(name: str) -> Path:
    """Where ``python -m harness.roofline_tools.calibrate --target <name>`` writes, and
    :func:`get_hardware` reads, a spec's calibration."""
    return CALIBRATION.with_name(f"{name}_calibration.json")


def load_calibrated(prior: HardwareSpec, path: Path | None = None) -> HardwareSpec:
    """``prior`` with what its calibration file measured and fitted, when one exists."""
    path = path or calibration_path(prior.name)
    if not path.is_file():
        return prior
    try:
        return spec_from_calibration(json.loads(path.read_text()), prior)
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"{path}: not a calibration file ({e}); rerun "
                        f"python -m harness.roofline_tools.calibrate --target {prior.name}") from e


def load_cpu(path: Path = CALIBRATION) -> HardwareSpec:
    """The CPU spec with what a calibration file measured and fitted, when one exists."""
    return load_calibrated(CPU_PRIOR, path)


def spec_from_calibration(report: dict[str, Any],
                          prior: HardwareSpec = CPU_PRIOR) -> HardwareSpec:
    """``prior`` with a calibration report's measured peak (``peak_flops_<dtype>``),
    bandwidth, widening costs, GEMM profile and fitted factors (its ``measured`` /
    ``profile`` / ``fit`` sections)."""
    fields = {f.name for f in dataclasses.fields(HardwareSpec)}
    m, prof = report.get("measured", {}), report.get("profile")
    kw: dict[str, Any] = {k: v for k, v in report["fit"].items() if k in fields}
    peaks = {k.removeprefix("peak_flops_"): float(v) for k, v in m.items()
             if k.startswith("peak_flops_")}
    if peaks:
        kw["peak_flops"] = {**prior.peak_flops, **peaks}
    if "mem_bw" in m:
        kw["mem_bw"] = float(m["mem_bw"])
    if "widen_s_per_elem" in m:
        kw["widen_s_per_elem"] = {str(k): float(v) for k, v in m["widen_s_per_elem"].items()}
    if prof:
        kw["gemm_profile"] = tuple((float(r), float(a), float(b)) for r, a, b in
                                   zip(prof["rows"], prof["layers_s_per_param"],
                                       prof["lm_head_s_per_param"], strict=True))
        kw["profile_dtype"] = str(prof["dtype"])
        # Measured GEMMs replace the fitted kernel terms; the real steps' norms, RoPE and
        # activations ride along in eff_profile (harness.roofline_tools.calibrate).
        kw.update(gemm_kernel_s=0.0, eff_elem=0.0, nongemm_kernel_s=0.0)
    return dataclasses.replace(prior, source="calibrated", **kw)


# Cards a published point may name that no spec stands for yet (issue #53's finding 9).
NOT_MODELLED = {
    "gb200": "roofline.hardware=gb200 is not modelled: a GB200 NVL72 rack's 72-GPU NVLink "
             "domain (and its Grace host memory) has no spec or all-reduce profile here; "
             "roofline.hardware=b200 stands for one 8-GPU B200 node (an unvalidated prior)",
}


def get_hardware(name: str) -> HardwareSpec:
    """A spec by name, with its calibration (``<name>_calibration.json`` next to this
    module) when one has been written: always for ``cpu``, for ``h200`` once a GPU check
    has fitted it."""
    key = name.lower()
    if key == "cpu":
        return load_cpu()
    if key in NOT_MODELLED:
        raise UserError(NOT_MODELLED[key])
    if key not in HARDWARE:
        raise UserError(f"unknown roofline.hardware {name!r}: use one of "
                        f"{', '.join([*HARDWARE, 'cpu'])}")
    return load_calibrated(HARDWARE[key])

"""What ``python -m harness.roofline_tools.calibrate`` measures, per target: the spec it fits,
the model and device of the real runs, and the training and held-out runs (Hydra
overrides). The held-out runs differ from the training ones in workload, batch mix or
backend, so their error is the model's, not the fit's."""

from __future__ import annotations

from dataclasses import dataclass

import torch

BASE = ["device=cpu", "cpu_threads=1", "model.dtype=float32", "quality.enabled=false",
        "cache.kv_budget=64MiB"]
RANDOM = ["workload=random", "workload.num_requests=16", "workload.input_max=384",
          "workload.output_min=4", "workload.output_max=48", "workload.output_mean=24",
          "workload.output_std=16"]
TRAIN: dict[str, list[str]] = {
    "random-paged-b16": [*RANDOM, "scheduler.max_num_seqs=16"],
    "random-paged-b4-long": [*RANDOM, "scheduler.max_num_seqs=4", "workload.input_mean=300",
                             "workload.input_min=128", "workload.num_requests=8"],
    "shared_prefix-paged": ["workload=shared_prefix", "workload.num_requests=12",
                            "workload.output_tokens=16"],
    "random-paged-b16-chunk128": [*RANDOM, "scheduler.max_num_seqs=16",
                                  "scheduler.max_num_batched_tokens=128", "workload.seed=9"],
}
HELD_OUT: dict[str, list[str]] = {
    "multiturn-paged": ["workload=multiturn", "workload.conversations=4", "workload.turns=2",
                        "workload.answer_tokens=24", "workload.system_words=60"],
    "random-contiguous-exact-b32": [*RANDOM, "backend=contiguous", "backend.reserve=exact",
                                    "scheduler.max_num_seqs=32", "workload.num_requests=24",
                                    "workload.seed=7"],
    "random-int8-b8": [*RANDOM, "backend=int8", "scheduler.max_num_seqs=8", "workload.seed=3"],
    # Chunked prefill at 128 tokens a step: every prefill shares its steps with decodes.
    "random-fp8-b16-chunk128": [*RANDOM, "backend=fp8", "scheduler.max_num_seqs=16",
                                "scheduler.max_num_batched_tokens=128", "workload.seed=5"],
    "random-sliding_window-b16": [*RANDOM, "backend=sliding_window", "backend.window=64",
                                  "scheduler.max_num_seqs=16", "workload.seed=11"],
}


@dataclass(frozen=True)
class Target:
    """What one calibration measures: the spec it fits (``hardware``, its prior from
    harness.roofline.hardware), the model and device the real runs use, and the runs.
    ``roofline`` are the dtype overrides that replay a run under executor=roofline (the
    model is the one the runs ran)."""

    hardware: str
    device: str
    model: str  # harness.model.load_model's source
    dtype: torch.dtype
    base: list[str]
    train: dict[str, list[str]]
    held_out: dict[str, list[str]]
    roofline: list[str]
    threads: int = 1


GPU_RANDOM = ["workload=random", "workload.num_requests=64", "workload.input_max=1024",
              "workload.output_min=8", "workload.output_max=128", "workload.output_mean=64",
              "workload.output_std=32"]
TINY_RANDOM = ["workload=random", "workload.num_requests=4", "workload.input_max=24",
               "workload.output_min=2", "workload.output_max=6", "workload.output_mean=4",
               "workload.output_std=2"]
TARGETS: dict[str, Target] = {
    # This machine, one thread: the spec `roofline.hardware=cpu` reads.
    "cpu": Target("cpu", "cpu", "smollm2", torch.float32, BASE, TRAIN, HELD_OUT,
                  ["roofline.dtype=float32", "roofline.weight_dtype=float32"]),
    # One H200 (the GPU check runs it): Llama-3.1-8B's shape, random bf16 weights, the
    # Triton paged kernels; the spec `roofline.hardware=h200` reads once committed.
    "h200": Target(
        "h200", "cuda", "random-llama8b", torch.bfloat16,
        ["device=cuda", "model=random_llama8b", "quality.enabled=false",
         "cache.kv_budget=8GiB", "scheduler.max_model_len=2048"],
        {"random-paged-b64": [*GPU_RANDOM, "scheduler.max_num_seqs=64"],
         "random-paged-b8-long": [*GPU_RANDOM, "scheduler.max_num_seqs=8",
                                  "workload.input_mean=800", "workload.input_min=256",
                                  "workload.num_requests=16"],
         "random-paged-b64-chunk256": [*GPU_RANDOM, "scheduler.max_num_seqs=64",
                                       "scheduler.max_num_batched_tokens=256",
                                       "workload.seed=9"]},
        {"multiturn-paged": ["workload=multiturn", "workload.conversations=16",
                             "workload.turns=2", "workload.answer_tokens=64",
                             "workload.ignore_eos=true"],  # lengths fixed whatever it says
         "random-contiguous-exact-b64": [*GPU_RANDOM, "backend=contiguous",
                                         "backend.reserve=exact", "scheduler.max_num_seqs=64",
                                         "workload.seed=7"],
         "random-fp8-b64": [*GPU_RANDOM, "backend=fp8", "scheduler.max_num_seqs=64",
                            "workload.seed=5"]},
        ["roofline.dtype=bfloat16", "roofline.weight_dtype=bfloat16"]),
    # The GPU check's dry run: the h200 target's code path on the CPU at tiny sizes (its
    # numbers mean nothing; the tests run it).
    "dry": Target(
        "h200", "cpu", "tiny", torch.float32,
        ["device=cpu", "cpu_threads=1", "model=tiny", "quality.enabled=false",
         "cache.kv_budget=256KiB"],
        {"random-b4": [*TINY_RANDOM, "scheduler.max_num_seqs=4"],
         "random-b2": [*TINY_RANDOM, "scheduler.max_num_seqs=2", "workload.seed=3"]},
        {"random-b4-seed5": [*TINY_RANDOM, "scheduler.max_num_seqs=4", "workload.seed=5"]},
        ["roofline.dtype=float32", "roofline.weight_dtype=float32"]),
}

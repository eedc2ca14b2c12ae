"""Triton kernels and their torch references (installed as ``harness.kernels``).

Importing this package imports neither triton nor any kernel: :mod:`.runtime` decides
first whether triton compiles or interprets (TRITON_INTERPRET must be set before triton's
first import). Each kernel module has the same three layers: private ``@triton.jit``
kernels, a launcher that asserts shapes and strides, allocates and computes the grid, and a
public function.

- :mod:`.store`: ``store_kv`` (full precision), ``store_kv_quant`` (fp8 e4m3 / int8 with
  per-(token, KV head) scales) — new K/V into the paged cache through the slot mapping.
- :mod:`.decode`: ``paged_decode`` — one query per sequence, GQA-grouped, plain or split-K,
  windows + sinks, 1-byte caches, slot lists (the token-evicting methods) with their logits.
- :mod:`.prefill`: ``paged_prefill`` — query chunks over cached prefix + themselves (or
  over slot lists), with each row's log-sum-exp.
- :mod:`.scores`: ``decode_weights`` / ``prefill_weights`` — the attention weights per slot
  the token-evicting methods score by, from those log-sum-exps.
- :mod:`.kivi`: ``kivi_decode`` — decode over KIVI's 2/4-bit codes, dequantized in the
  kernel, and its full-precision residual blocks.
- :mod:`.quest`: ``quest_select`` / ``quest_decode`` — quest's per-KV-head block choice
  by the key bounds, then ``paged_decode`` over the chosen blocks only.
- :mod:`.reference`: the plain torch version of each (no triton needed).
- :mod:`.cases`: random paged caches for tests and benchmarks.
- :mod:`.bench`: a standalone decode benchmark (``python -m harness.kernels.bench``);
  the GPU check itself is :mod:`harness.gpucheck`.

Block copies stay in torch (``backends.paged_storage``).
"""

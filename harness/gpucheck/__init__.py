"""The GPU check: one prepared command that measures kvbench on a CUDA machine.

``scripts/gpu_check.sh`` (or ``python -m harness.gpucheck``) runs named *sections*, each in
its own process with its own time budget, so that a section that fails, hangs or breaks
the CUDA context is recorded and the next one still runs. Everything goes to one output
folder: ``<section>.json`` (its results, saved as they come), ``<section>.log`` (its
output), ``status.json`` (per section: ok / failed / timeout / skipped, seconds, error) and
``summary.md`` (the tables). ``--dry-run`` runs the same sections on the CPU at tiny sizes
(kernels under Triton's interpreter), which the test suite does, so the check cannot rot
between GPU runs.

Modules: :mod:`.profile` (sizes and budgets, GPU and dry run), :mod:`.sections` (the
registry and the per-section context), :mod:`.orchestrate` (the driver), and one module per
kind of section: :mod:`.env_check`, :mod:`.kernel_checks`, :mod:`.engine_checks`,
:mod:`.pytest_checks`, :mod:`.fa4_check` (with :mod:`.fa4`, flash-attn 4 behind the
flash_attn backend's seam); :mod:`.timing` times on either side; :mod:`.summary` writes
the tables.
"""

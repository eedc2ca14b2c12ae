"""The what-if's own tools: calibration (calibrate, kernel_fit, targets), validation
against published points (validate) and the experiments behind docs/ (experiments).

Nothing a run imports lives here: a run imports harness.roofline (the executor plug-in,
its hardware and model specs, and the JSON they read); these tools import the runner to
measure and compare, so they sit above it."""

"""Kept so that `python -m harness.roofline.experiments` (older scripts, notes and CI) still
works: the tool is harness/roofline_tools/experiments.py. Nothing imports this module."""

import runpy

if __name__ == "__main__":
    runpy.run_module("harness.roofline_tools.experiments", run_name="__main__", alter_sys=True)

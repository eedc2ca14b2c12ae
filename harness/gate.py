"""`python -m harness.gate`: the command lives in harness/app/gate.py (CI, scripts and notes
call it by this name). Nothing imports this module."""

import runpy

if __name__ == "__main__":
    runpy.run_module("harness.app.gate", run_name="__main__", alter_sys=True)

"""`python -m harness.sla`: the command lives in harness/app/sla.py (CI, scripts and notes
call it by this name). Nothing imports this module."""

import runpy

if __name__ == "__main__":
    runpy.run_module("harness.app.sla", run_name="__main__", alter_sys=True)

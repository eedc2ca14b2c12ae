"""`python -m harness.report`: the command lives in harness/app/report.py (CI, scripts and notes
call it by this name). Nothing imports this module."""

import runpy

if __name__ == "__main__":
    runpy.run_module("harness.app.report", run_name="__main__", alter_sys=True)

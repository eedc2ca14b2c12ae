"""The example traces in traces/, generated here from a fixed seed (none is copied from a
published trace): ``python -m harness.workloads.trace_examples [folder]``.

Sized for a 2-core CPU with the default model (a replay takes about a minute) and for the
tiny model in tests (seconds):

- ``mooncake_example.jsonl``: 24 requests over ~10 s behind three shared documents of 1-2
  hash blocks (512 tokens each) plus 0-2 blocks of their own, one of them longer than the
  default max_model_len (2048) to show truncation; arrivals at least 0.1 s apart;
- ``azure_example.csv``: 24 requests over ~12 s, lognormal context lengths (mean ~300)
  and outputs, date-time stamps as the Azure traces write them;
- ``kvbench_example.csv`` / ``.jsonl`` (the same rows): 4 conversations of 3 turns whose
  prompts grow by the previous answer and a new message, and 6 single requests with
  priorities.
"""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
import random
import sys
from pathlib import Path

SEED = 13
FOLDER = Path(__file__).resolve().parents[2] / "traces"


def mooncake_rows(rng: random.Random) -> list[dict[str, object]]:
    docs = [[0, 1], [2], [3, 4]]  # shared leading blocks: three documents
    next_id, t_ms, rows = 5, 0, []
    for i in range(24):
        t_ms += 100 + int(rng.expovariate(1 / 320))
        own = 4 if i == 17 else rng.randrange(0, 2)  # row 17: 5-6 blocks, > 2048 tokens
        ids = list(docs[rng.randrange(len(docs))]) + list(range(next_id, next_id + own))
        next_id += own
        # The last block is partly filled, as in the published traces.
        length = (len(ids) - 1) * 512 + rng.randrange(64, 513)
        rows.append({"timestamp": t_ms, "input_length": length,
                     "output_length": rng.randrange(8, 49), "hash_ids": ids})
    return rows


def azure_rows(rng: random.Random) -> list[dict[str, object]]:
    t = dt.datetime(2023, 11, 16, 18, 15, 46, 680590)
    rows = []
    for _ in range(24):
        t += dt.timedelta(seconds=rng.expovariate(2.0))
        rows.append({"TIMESTAMP": t.strftime("%Y-%m-%d %H:%M:%S.%f") + "0",
                     "ContextTokens": max(4, min(1500, int(rng.lognormvariate(5.5, 0.7)))),
                     "GeneratedTokens": max(1, min(128, int(rng.lognormvariate(3.2, 0.6))))})
    return rows


def kvbench_rows(rng: random.Random) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for c in range(4):
        t, prompt = round(rng.uniform(0, 4), 3), rng.randrange(60, 200)
        for turn in range(3):
            out = rng.randrange(16, 48)
            rows.append({"arrival_s": t, "prompt_tokens": prompt, "output_tokens": out,
                         "conversation_id": f"c{c}", "turn": turn, "priority": 0})
            t = round(t + rng.uniform(2, 5), 3)  # the user reads, then answers
            prompt += out + rng.randrange(10, 40)
    for _ in range(6):
        rows.append({"arrival_s": round(rng.uniform(0, 10), 3),
                     "prompt_tokens": rng.randrange(20, 400),
                     "output_tokens": rng.randrange(8, 64), "conversation_id": "",
                     "turn": "", "priority": rng.randrange(2)})
    return sorted(rows, key=lambda r: float(r["arrival_s"]))  # type: ignore[arg-type]


def _csv(rows: list[dict[str, object]]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    return buf.getvalue()


def _jsonl(rows: list[dict[str, object]]) -> str:
    return "".join(json.dumps({k: v for k, v in r.items() if v != ""}) + "\n" for r in rows)


def example_files() -> dict[str, str]:
    """File name -> content of every example trace."""
    rng = random.Random(SEED)
    moon, azure, ours = mooncake_rows(rng), azure_rows(rng), kvbench_rows(rng)
    return {"mooncake_example.jsonl": _jsonl(moon), "azure_example.csv": _csv(azure),
            "kvbench_example.csv": _csv(ours), "kvbench_example.jsonl": _jsonl(ours)}


def main(argv: list[str]) -> int:
    out = Path(argv[0]) if argv else FOLDER
    out.mkdir(parents=True, exist_ok=True)
    for name, text in example_files().items():
        (out / name).write_text(text)
        print(f"wrote {out / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

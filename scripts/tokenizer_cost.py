"""What a served front end's per-prompt-token time can physically be: a BPE tokenizer's
encode time per token, on this machine's CPU, one thread.

    python scripts/tokenizer_cost.py [TOKENIZER_JSON]

Encodes the repository's docs (English prose with code, ~60k tokens) as prompts of ~4,000
tokens with Hugging Face ``tokenizers`` (the Rust BPE vLLM's and SGLang's servers run), and
prints the best and the median of five passes in microseconds a token, with the
tokenizer's vocabulary size and the CPU. Default tokenizer: the first
``tokenizer.json`` under ``$KVBENCH_CACHE/tokenizers`` (the GGUF models' tokenizers, written
there by the main job's first run). harness/roofline_tools/validate.py bounds the fitted
front ends' per-token term by it (``TOKENIZE_S``)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def main() -> None:
    from tokenizers import Tokenizer

    if len(sys.argv) > 1:
        path = Path(sys.argv[1])
    else:
        root = Path(os.environ.get("KVBENCH_CACHE", Path.home() / ".cache" / "kvbench"))
        found = sorted((root / "tokenizers").glob("*/tokenizer.json"))
        if not found:
            sys.exit(f"no tokenizer.json under {root / 'tokenizers'}: run the main job once "
                     "(it unpacks the GGUF model's tokenizer there) or pass a path")
        path = found[0]
    tok = Tokenizer.from_file(str(path))
    docs = Path(__file__).resolve().parent.parent / "docs"
    text = "".join(p.read_text() for p in sorted(docs.glob("*.md")))
    total = len(tok.encode(text).ids)
    step = max(1, len(text) * 4000 // total)
    prompts = [text[i:i + step] for i in range(0, len(text), step)]
    per: list[float] = []
    for _ in range(5):
        t0, n = time.perf_counter(), 0
        for p in prompts:
            n += len(tok.encode(p).ids)
        per.append((time.perf_counter() - t0) / n)
    per.sort()
    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown CPU") \
        if Path("/proc/cpuinfo").exists() else "unknown CPU"
    print(f"{path.parent.name} ({tok.get_vocab_size()} entries) on {cpu}: "
          f"{per[0] * 1e6:.2f} us a token best, {per[2] * 1e6:.2f} median of 5 passes "
          f"({len(prompts)} prompts of ~{n // len(prompts)} tokens)")


if __name__ == "__main__":
    main()

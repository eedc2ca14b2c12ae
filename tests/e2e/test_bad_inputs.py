"""Bad inputs, table-driven: each row is the input (a CLI override, a model file, a run
folder for report or gate), the exit status, and a phrase the message must contain; a
message about a file must name it. A traceback never stands in for a message.

The CLI rows run ``python -m harness`` (each fails before any model work); the model files
go through ``load_model`` and the report/gate rows through their ``main``, in-process.
Add a row for every bad input fixed, so that it stays fixed.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from harness.app.gate import main as gate
from harness.app.report import main as report
from harness.errors import UserError
from harness.model import load_model, save_hf
from tests.app.test_report import write_run

ROOT = Path(__file__).resolve().parents[2]


def _gguf(path: Path) -> Path:
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("token_embd.weight", np.ones((64, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _runs(root: Path) -> Path:
    for i, backend in enumerate(("paged", "contiguous")):
        write_run(root / f"{i}-{backend}", {"name": backend, "block_size": 16},
                  {"requests.finished": 4, "memory.waste_pct": 2.0})
    return root


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The bad inputs, by name (the tables' ``{placeholders}``)."""
    t = tmp_path_factory.mktemp("bad")
    f: dict[str, Path] = {"a_folder": t / "a_folder", "a_file": t / "a_file.txt",
                          "missing": t / "missing"}
    f["a_folder"].mkdir()
    f["a_file"].write_text("hello\n")
    good = _gguf(t / "good.gguf").read_bytes()
    f["truncated_gguf"] = t / "truncated.gguf"
    f["truncated_gguf"].write_bytes(good[: len(good) - 100])
    f["not_gguf"] = t / "not.gguf"
    f["not_gguf"].write_text("hello\n")
    f["gguf_folder"] = t / "folder.gguf"
    f["gguf_folder"].mkdir()
    for name, text in (("hf_bad_json", '{"model_type": "llama",'), ("hf_list_json", "[1, 2]"),
                       ("hf_missing_key", '{"model_type": "llama"}')):
        f[name] = t / name
        f[name].mkdir()
        (f[name] / "config.json").write_text(text)
    for name, raw in ROOFLINE_JSON.items():
        f[name] = t / f"{name}.json"
        f[name].write_text(raw)
    f["hf_truncated_weights"] = t / "hf_cut"
    save_hf(load_model("tiny").model, f["hf_truncated_weights"], byte_tokenizer=True)
    weights = f["hf_truncated_weights"] / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    f["user_folder"] = t / "user_folder"  # a user's own files, named like a run's
    f["user_folder"].mkdir()
    (f["user_folder"] / "config.yaml").write_text("mine: true\n")
    (f["user_folder"] / "requests.csv").write_text("id\n1\n")
    f["finished_run"] = t / "finished_run"
    f["finished_run"].mkdir()
    (f["finished_run"] / "metrics.json").write_text("{}")
    f["sweep"] = _runs(t / "sweep")
    f["baseline"] = t / "baseline.json"
    assert gate(["--write-baseline", str(f["baseline"]), str(f["sweep"])]) == 0
    f["metrics_list"] = t / "metrics_list"
    shutil.copytree(f["sweep"], f["metrics_list"])
    (f["metrics_list"] / "1-contiguous" / "metrics.json").write_text("[1, 2]")
    f["metrics_string"] = t / "metrics_string"  # a number stored as a string (issue 27)
    shutil.copytree(f["sweep"], f["metrics_string"])
    m = json.loads((f["metrics_string"] / "1-contiguous" / "metrics.json").read_text())
    m["requests.finished"] = "4"
    (f["metrics_string"] / "1-contiguous" / "metrics.json").write_text(json.dumps(m))
    f["metrics_broken"] = t / "metrics_broken"
    shutil.copytree(f["sweep"], f["metrics_broken"])
    (f["metrics_broken"] / "1-contiguous" / "metrics.json").write_text('{"requests.fin')
    f["config_broken"] = t / "config_broken"
    shutil.copytree(f["sweep"], f["config_broken"])
    (f["config_broken"] / "1-contiguous" / "config.yaml").write_text("backend: [paged\n")
    return {k: str(v) for k, v in f.items()}


# --- python -m harness ---------------------------------------------------------------------
# (arguments, exit status, phrase in the output, phrase that must not be there)
CLI = [
    (["backend=nope"], 2, "Could not find 'backend/nope'", "Traceback"),
    (["backend.block_size=abc"], 2, "could not be converted to Integer", "Traceback"),
    (["backend=paged_schema"], 2, "Could not find 'backend/paged_schema'", "Traceback"),
    (["-m", "backend=paged,paged_schema"], 2, "use backend=paged", "Traceback"),
    (["model=gguf", "model.path={truncated_gguf}"], 2,
     "{truncated_gguf} cannot be read as GGUF", "Traceback"),
    (["hydra.run.dir={finished_run}"], 2, "already holds another run's results", "Traceback"),
    (["-m", "workload=random", "workload.rate=1,-1"], 2,  # issue 27: job #0 ran first
     "sweep job #1 (workload.rate=-1): workload.rate=-1.0 is out of range",
     "Traceback"),
    (["hydra.run.dir={user_folder}"], 2,
     "results folder {user_folder} is not empty: it holds files (config.yaml, requests.csv)",
     "Traceback"),
    (["hydra.run.dir={sweep}"], 2, "results folder {sweep} is not empty: it holds a sweep",
     "Traceback"),
    (["executor=roofline", "roofline.model={rf_zero_heads}"], 2,
     "{rf_zero_heads}: num_attention_heads=0 must be >= 1", "Traceback"),
    (["--help"], 0, "== Configuration groups ==", "_schema"),
]


@pytest.mark.parametrize(("args", "code", "phrase", "absent"), CLI,
                         ids=[" ".join(c[0]) for c in CLI])
def test_cli(files: dict[str, str], args: list[str], code: int, phrase: str, absent: str,
             tmp_path: Path) -> None:
    argv = [a.format(**files) for a in args]
    if "--help" not in argv:
        argv += [f"results_dir={tmp_path}"]
        argv += [] if any(a.startswith("model=") for a in argv) else ["model=tiny"]
    p = subprocess.run([sys.executable, "-m", "harness", *argv], capture_output=True,
                       text=True, cwd=ROOT, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == code, out
    assert phrase.format(**files) in out and absent not in out, out


def test_a_refused_folder_is_left_as_it_was(files: dict[str, str]) -> None:
    # (after the CLI rows: the refused run wrote nothing into the other run's folder)
    assert sorted(p.name for p in Path(files["finished_run"]).iterdir()) == ["metrics.json"]
    user = Path(files["user_folder"])
    assert sorted(p.name for p in user.iterdir()) == ["config.yaml", "requests.csv"]
    assert (user / "config.yaml").read_text() == "mine: true\n"
    assert sorted(p.name for p in Path(files["sweep"]).iterdir()) == ["0-paged", "1-contiguous"]


# --- model files -----------------------------------------------------------------------------
# (model source, path, phrase); the message must also name the path
MODEL_FILES = [
    ("gguf", "{gguf_folder}", "is a folder, not a file"),
    ("gguf", "{truncated_gguf}", "truncated"),
    ("gguf", "{not_gguf}", "is not a GGUF file"),
    ("hf", "{hf_bad_json}", "is not valid JSON"),
    ("hf", "{hf_list_json}", "holds a JSON list, not an object"),
    ("hf", "{hf_missing_key}", "lacks 'num_attention_heads'"),
    ("hf", "{a_file}", "is a file, not a Hugging Face model folder"),
    ("hf", "{hf_truncated_weights}", "cannot be read as safetensors"),
]


@pytest.mark.parametrize(("source", "path", "phrase"), MODEL_FILES,
                         ids=[f"{s}:{p}" for s, p, _ in MODEL_FILES])
def test_model_file(files: dict[str, str], source: str, path: str, phrase: str) -> None:
    where = path.format(**files)
    with pytest.raises(UserError) as e:
        load_model(source, where)
    assert phrase in str(e.value) and Path(where).name in str(e.value), str(e.value)


# --- roofline specs from a config.json (issue 27): one error naming the file and the key --
_LLAMA = {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096,
          "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
          "vocab_size": 128256}
ROOFLINE_JSON = {
    "rf_list": "[1, 2]",
    "rf_zero_heads": json.dumps({**_LLAMA, "num_attention_heads": 0}),
    "rf_null_heads": json.dumps({**_LLAMA, "num_attention_heads": None}),
    "rf_str_heads": json.dumps({**_LLAMA, "num_key_value_heads": "8"}),
    "rf_float_layers": json.dumps({**_LLAMA, "num_hidden_layers": 32.5}),
    "rf_no_layers": json.dumps({**_LLAMA, "num_hidden_layers": 0}),
    "rf_neg_layers": json.dumps({**_LLAMA, "num_hidden_layers": -2}),
    "rf_kv_not_dividing": json.dumps({**_LLAMA, "num_key_value_heads": 5}),
    "rf_deepseek": json.dumps({**_LLAMA, "model_type": "deepseek_v3",
                               "n_routed_experts": 256, "num_experts_per_tok": 8}),
    "rf_gpt_oss": json.dumps({**_LLAMA, "model_type": "gpt_oss", "num_local_experts": 32,
                              "num_experts_per_tok": 4}),
    "rf_llama4": json.dumps({**_LLAMA, "model_type": "llama4_text", "num_local_experts": 16,
                             "num_experts_per_tok": 1, "interleave_moe_layer_step": 1}),
}
# (file, phrase: the key and what is wrong); the message must also name the file
ROOFLINE_SPECS = [
    ("rf_list", "holds a JSON list, not an object"),
    ("rf_zero_heads", "num_attention_heads=0 must be >= 1"),
    ("rf_null_heads", "lacks 'num_attention_heads' (a positive integer)"),
    ("rf_str_heads", "num_key_value_heads='8' is not an integer"),
    ("rf_float_layers", "num_hidden_layers=32.5 is not an integer"),
    ("rf_no_layers", "num_hidden_layers=0 must be >= 1"),
    ("rf_neg_layers", "num_hidden_layers=-2 must be >= 1"),
    ("rf_kv_not_dividing", "num_attention_heads=32 is not a multiple of num_key_value_heads=5"),
    # DeepSeek's layout is read (GLM-4.5, DeepSeek-V3, Kimi-K2): strictly, key by key
    ("rf_deepseek", "lacks 'moe_intermediate_size' (a positive integer)"),
    ("rf_gpt_oss", "(num_local_experts=32, model_type 'gpt_oss')"),
    ("rf_llama4", "(num_local_experts=16, model_type 'llama4_text')"),
]


@pytest.mark.parametrize(("name", "phrase"), ROOFLINE_SPECS, ids=[n for n, _ in ROOFLINE_SPECS])
def test_roofline_spec_file(files: dict[str, str], name: str, phrase: str) -> None:
    from harness.roofline.models import get_model_spec

    with pytest.raises(UserError) as e:
        get_model_spec(files[name])
    assert phrase in str(e.value) and files[name] in str(e.value), str(e.value)


# --- report and gate -------------------------------------------------------------------------
# (tool, arguments, exit status, phrase)
TOOLS = [
    ("report", ["{metrics_list}"], 0, "holds a JSON list, not an object of metrics"),
    ("report", ["{metrics_string}"], 0, "{metrics_string}/1-contiguous/metrics.json: "
     "requests.finished='4' is stored as a str, not a number"),
    ("gate", ["{metrics_string}", "--baseline", "{baseline}"], 1,
     "UNREADABLE: {metrics_string}/1-contiguous/metrics.json: requests.finished='4' is stored"),
    ("gate", ["{metrics_list}", "--baseline", "{baseline}"], 1,
     "UNREADABLE: {metrics_list}/1-contiguous/metrics.json: holds a JSON list"),
    ("report", ["{metrics_broken}"], 0, "{metrics_broken}/1-contiguous/metrics.json: not valid"),
    ("report", ["{config_broken}"], 0, "{config_broken}/1-contiguous/config.yaml: not valid YAML"),
    ("report", ["{missing}"], 2, "{missing} does not exist"),
    ("report", ["{a_file}"], 2, "{a_file} is a file, not a folder"),
    ("report", ["{sweep}", "--out", "{a_file}"], 2, "--out {a_file} is a file"),
    ("gate", ["{sweep}", "--write-baseline", "{a_folder}"], 2,
     "--write-baseline {a_folder} is a folder"),
    ("gate", ["{sweep}", "--baseline", "{a_folder}"], 2, "is a folder, not a baseline file"),
]


@pytest.mark.parametrize(("tool", "args", "code", "phrase"), TOOLS,
                         ids=[f"{t} {' '.join(a)}" for t, a, _, _ in TOOLS])
def test_report_and_gate(files: dict[str, str], tool: str, args: list[str], code: int,
                         phrase: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [a.format(**files) for a in args]
    if tool == "report" and "--out" not in argv:
        argv += ["--out", str(tmp_path / "report")]
    assert {"report": report, "gate": gate}[tool](argv) == code
    out = capsys.readouterr()
    assert phrase.format(**files) in out.out + out.err, out


def test_baseline_file_stays_json(files: dict[str, str]) -> None:
    assert json.loads(Path(files["baseline"]).read_text())["format"].startswith("kvbench")

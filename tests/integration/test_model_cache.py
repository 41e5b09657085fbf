"""One model cache per user, not per directory: the default `model.cache_dir` is the per-user cache
(`$LIBRA_CACHE_DIR`, else `$XDG_CACHE_HOME/libra`, else `~/.cache/libra`), the same from every
directory; `tiny-random` is built from SmolLM2's tokenizer alone, never converting SmolLM2's
weights; a `cache_dir` of the config's own still wins."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.models import load_tokenizer, model_cache, resolve_model_dir, user_cache_dir
from services.common.runconfig import ModelConfig

pytestmark = pytest.mark.integration


def test_the_default_cache_is_the_users_from_every_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LIBRA_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    seen = set()
    for where in ("a", "b/c"):
        (tmp_path / where).mkdir(parents=True)
        monkeypatch.chdir(tmp_path / where)
        seen.add(model_cache(ModelConfig()))
    assert seen == {tmp_path / "home" / ".cache" / "libra" / "models"}
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert user_cache_dir() == tmp_path / "xdg" / "libra"
    monkeypatch.setenv("LIBRA_CACHE_DIR", str(tmp_path / "mine"))
    assert model_cache(ModelConfig()) == tmp_path / "mine" / "models"
    assert model_cache(ModelConfig(cache_dir=str(tmp_path / "own"))) == tmp_path / "own"


def test_tiny_random_needs_only_the_tokenizer_of_smollm2(
    tiny_model: ModelConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LIBRA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    cfg = ModelConfig(source="tiny-random")
    built = resolve_model_dir(cfg)
    models = tmp_path / "cache" / "models"
    assert built.parent == models and (built / "model.safetensors").is_file()
    assert sorted(p.name for p in models.iterdir() if not p.name.startswith(".")) == [
        "smollm2-135m-instruct-tokenizer",
        "tiny-random-llama-h32-0",
    ]  # no converted SmolLM2 (517 MB), only its tokenizer (3 MB)
    assert sum(f.stat().st_size for f in (models / "smollm2-135m-instruct-tokenizer").iterdir()) < 10e6
    assert not (tmp_path / ".libra").exists()  # nothing in the directory it ran from
    # the same model as one built beside a converted SmolLM2: same tokenizer, same seeded weights
    assert load_tokenizer(cfg).encode("What is 17 * 3? <tool_call>") == load_tokenizer(tiny_model).encode(
        "What is 17 * 3? <tool_call>"
    )
    assert (built / "model.safetensors").read_bytes() == (
        resolve_model_dir(tiny_model) / "model.safetensors"
    ).read_bytes()


def test_a_built_models_tokenizer_loads_as_autotokenizer_loads_it_without_torch(
    tiny_model: ModelConfig,
) -> None:
    """The tokenizers Libra writes are loaded as their class directly (no modeling code, no
    torch, in the scheduler): the same class, ids and special tokens AutoTokenizer gives."""
    import subprocess
    import sys

    import transformers

    from services.common.models import vocabulary_size

    ours = load_tokenizer(tiny_model)
    auto = transformers.AutoTokenizer.from_pretrained(str(resolve_model_dir(tiny_model)))
    assert type(ours) is type(auto)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3? <calc>2+3</calc>"}]
    assert ours.apply_chat_template(chat, add_generation_prompt=True) == auto.apply_chat_template(
        chat, add_generation_prompt=True
    )
    assert ours("héllo wörld 123")["input_ids"] == auto("héllo wörld 123")["input_ids"]
    assert (ours.eos_token_id, ours.bos_token_id, len(ours)) == (
        auto.eos_token_id,
        auto.bos_token_id,
        len(auto),
    )
    config = transformers.AutoConfig.from_pretrained(str(resolve_model_dir(tiny_model)))
    assert vocabulary_size(tiny_model) == config.vocab_size
    probe = (
        "import sys; from services.common.models import load_tokenizer, vocabulary_size; "
        "from services.common.runconfig import ModelConfig; "
        f"m = ModelConfig(source='tiny-random', cache_dir={str(tiny_model.cache_dir)!r}); "
        "load_tokenizer(m); vocabulary_size(m); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr[-2000:]

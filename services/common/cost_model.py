"""Analytical cost model for rollout (prefill, decode) and training, calibratable from profiles.

Decode is priced as the slower of compute and memory traffic (weights plus KV cache read per step)
plus a per-layer tensor-parallel all-reduce latency; prefill and training as FLOPs at an achieved
MFU. `calibrate()` fits one multiplier per kind from measured samples, so the same formulas serve
the planner on real hardware and the simulator.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

PRESET_DIR = Path(__file__).parent / "presets"


@dataclass(frozen=True, slots=True)
class GPUSpec:
    name: str
    flops: float
    """Dense BF16 FLOP/s."""
    mem_bw: float
    """HBM bytes/s."""
    mem_bytes: float
    nvlink_bw: float = 200e9
    """Per-GPU intra-node bytes/s (all-reduce, weight sync inside a node)."""
    net_bw: float = 25e9
    """Per-GPU inter-node bytes/s (weight sync, state fetch across nodes)."""
    allreduce_latency_s: float = 8e-6
    gpus_per_node: int = 8
    pcie_bw: float = 25e9
    """Per-GPU host<->device bytes/s achieved for offload and onload (PCIe Gen4 x16: ~25 GB/s)."""

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GPUSpec:
        return cls(**_coerce(cls, data))


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    params: float
    """Total parameters (memory)."""
    active_params: float
    """Parameters touched per token (FLOPs); equals `params` for dense models."""
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int
    bytes_per_param: int = 2
    max_context: int = 0
    """Position window (max_position_embeddings); 0 = unbounded."""

    @property
    def weight_bytes(self) -> float:
        return self.params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> float:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_param

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelSpec:
        return cls(**_coerce(cls, data))


_INT_FIELDS = {"layers", "hidden", "kv_heads", "head_dim", "bytes_per_param", "gpus_per_node", "max_context"}


def _coerce(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    """Keep known fields; YAML may give `1.2e14` as a string, so cast numbers explicitly."""
    names = {f.name for f in fields(cls)}
    out: dict[str, Any] = {}
    for k, v in data.items():
        if k in names:
            out[k] = v if k == "name" else (int(float(v)) if k in _INT_FIELDS else float(v))
    return out


@dataclass(slots=True)
class Calibration:
    """Multipliers on the analytical times, fitted from measured profiles (1.0 = trust the formulas)."""

    decode: float = 1.0
    prefill: float = 1.0
    train: float = 1.0
    mem_efficiency: float = 0.8
    prefill_mfu: float = 0.5
    train_mfu: float = 0.4
    tp_mfu_decay: float = 0.93
    """Training MFU is multiplied by this per doubling of TP (communication overhead)."""
    tp_decode_efficiency: float = 0.88
    """Achieved bandwidth per doubling of decode TP: smaller shards, more sync points
    (TP4 decodes about 2.8x faster than TP1, TP8 about 4.3x, not 8x)."""
    decode_overhead_s: float = 0.002
    """Per decode iteration: scheduling, sampling, detokenisation and launch gaps of the serving
    engine that do not shrink with TP (see docs/simulator.md for the source)."""
    train_tokens_per_gpu: int = 16384
    """Longest sequence one GPU trains without sequence parallelism (verl's default
    ppo_max_token_len_per_gpu); longer sequences need Ulysses SP, which costs MFU like TP."""
    colocate_fixed_s: float = 10.0
    """Fixed part of a colocated role switch (engine sleep/wake, memory release, process sync),
    on top of the byte moves (see docs/simulator.md for the source)."""
    join_fixed_s: float = 20.0
    """Fixed part of a hybrid worker joining the data-parallel group at a step boundary
    (communicator rebuild and regrouping), on top of its state fetch."""
    activation_recompute: bool = True
    """Training recomputes activations in the backward pass (one more forward per micro-batch):
    verl's default (`enable_gradient_checkpointing: True`) and AReaL's example GRPO configs;
    Korthikanti et al. (arXiv 2205.05198) Table 4 measure full recompute at +39 % of a layer."""
    kv_transfer_efficiency: float = 0.71
    """Share of the engine GPUs' network bandwidth a KV-cache transfer achieves: vLLM with the
    Mooncake connector measured 142 GB/s of ~200 GB/s over 8 RoCE NICs (71 %; a 32k-token KV of
    4.5 GB in 31.7 ms, Mooncake docs, vllm-v1-pd-performance)."""
    sync_fixed_s: float = 2.0
    """Fixed part of a weight push to rollout engines (coordination, engine pause/resume)."""
    kv_block_tokens: int = 1
    """Tokens per KV-cache block: a prefix cache finds only whole blocks of a cached prefix, and
    the rest is prefilled again. vLLM's CPU build uses 128-token blocks (a 100-token prompt is
    never shared by a group's siblings there); GPU builds and the `hf` engine 16, under 1 % of
    the presets' contexts, which they leave at 1. `libra calibrate` records its engine's."""
    host_sharing: float = 0.0
    """How much the engines of one host slow each other: every other engine mid-iteration
    lengthens an engine's iterations (and prefills) by this share of their cost alone. 0 for
    engines on devices of their own, as on GPU nodes (nothing measured here says otherwise); two
    one-thread vLLM engines on this 2-core CPU measured 0.6-0.8 (`libra bench live --backend vllm`:
    their iterations beside the other engine's against those alone, tools/engine_iterations.py).
    A profile's engines are all on its one host."""


def relative_tpot(tp: int, calib: Calibration | None = None) -> float:
    """Time per output token of a TP-`tp` replica relative to TP1, where decoding reads the
    weights (memory-bound): TP splits the reads, at `tp_decode_efficiency` per doubling. Used
    where no GPU or model is known (the live scheduler pricing a migration)."""
    c = calib or Calibration()
    return 1.0 / (tp * c.tp_decode_efficiency ** math.log2(max(1, tp)))


@dataclass(frozen=True, slots=True)
class Profile:
    """One measured sample: kind in {decode, prefill, train}, its inputs and the seconds it took."""

    kind: str
    seconds: float
    batch: int = 1
    context: int = 0
    tokens: int = 0
    tp: int = 1
    gpus: int = 1


@dataclass(slots=True)
class CostModel:
    gpu: GPUSpec
    model: ModelSpec
    calib: Calibration = field(default_factory=Calibration)
    train_state_bytes_per_param: float = 16.0
    """Mixed-precision Adam: weights, gradients, master weights and two moments."""
    reserved_fraction: float = 0.1
    """HBM kept back for activations and the runtime on rollout engines."""

    def _allreduce_s(self, tp: int, batch: int) -> float:
        if tp == 1:
            return 0.0
        msg = batch * self.model.hidden * self.model.bytes_per_param * 2 * (tp - 1) / tp
        per_layer = 2 * (self.gpu.allreduce_latency_s + msg / self.gpu.nvlink_bw)
        return self.model.layers * per_layer

    def decode_bytes(self, batch: int, avg_context: float) -> float:
        """What one decode iteration reads: the weights and the batch's KV cache, once."""
        return self.model.weight_bytes + batch * avg_context * self.model.kv_bytes_per_token

    def forward_flops(self, tokens: float, context: float) -> float:
        """A forward pass over `tokens` query tokens, each attending to `context` tokens on average."""
        return (
            2 * self.model.active_params * tokens
            + 4 * self.model.layers * self.model.hidden * tokens * context
        )

    def _decode_read_s(self, batch: int, avg_context: float, tp: int) -> float:
        """Reading the weights and the batch's KV cache once, at the achieved share of HBM bandwidth."""
        c = self.calib
        eff = c.mem_efficiency * c.tp_decode_efficiency ** math.log2(tp)
        return self.decode_bytes(batch, avg_context) / (tp * self.gpu.mem_bw * eff)

    def decode_step_s(self, batch: int, avg_context: float, tp: int) -> float:
        """One continuous-batching decode iteration for `batch` sequences of `avg_context` tokens."""
        return self.verify_step_s(batch, avg_context, tp, batch)

    def verify_step_s(self, batch: int, avg_context: float, tp: int, query_tokens: int) -> float:
        """One decode iteration in which the `batch` sequences verify `query_tokens` tokens in all
        (one each without speculative decoding; 1 + k with k drafted tokens): the weights and each
        sequence's KV are read once, while FLOPs and the all-reduce grow with the query tokens."""
        if batch <= 0:
            return 0.0
        c = self.calib
        q = max(batch, query_tokens)
        mem = self._decode_read_s(batch, avg_context, tp)
        compute = self.forward_flops(q, avg_context) / (tp * self.gpu.flops * c.prefill_mfu)
        return c.decode * (max(mem, compute) + self._allreduce_s(tp, q)) + c.decode_overhead_s

    def verify_cost(self, batch: int, avg_context: float, tp: int) -> Callable[[int], float]:
        """`verify_step_s` of this batch as a function of its query tokens, with everything that
        does not depend on them computed once (the speculation policy prices many draft lengths)."""
        c = self.calib
        mem = self._decode_read_s(batch, avg_context, tp)
        per_q = self.forward_flops(1, avg_context) / (tp * self.gpu.flops * c.prefill_mfu)
        ar_fixed = self._allreduce_s(tp, 0)  # the all-reduce is linear in the tokens it carries
        ar_per_q = self._allreduce_s(tp, 1) - ar_fixed
        d, over = c.decode, c.decode_overhead_s

        def step_s(query_tokens: int) -> float:
            q = max(batch, query_tokens)
            return d * (max(mem, per_q * q) + ar_fixed + ar_per_q * q) + over

        return step_s

    def prefill_s(self, tokens: int, context_before: int, tp: int) -> float:
        """Prefill `tokens` new tokens after `context_before` cached ones."""
        if tokens <= 0:
            return 0.0
        c = self.calib
        flops = self.forward_flops(tokens, context_before + tokens / 2)  # causal: half the new tokens
        return c.prefill * flops / (tp * self.gpu.flops * c.prefill_mfu) + self._allreduce_s(tp, 1)

    def kv_capacity_tokens(self, tp: int) -> int:
        free = tp * self.gpu.mem_bytes * (1 - self.reserved_fraction) - self.model.weight_bytes
        return max(0, int(free / self.model.kv_bytes_per_token))

    def train_mfu(self, tp: int) -> float:
        return self.calib.train_mfu * self.calib.tp_mfu_decay ** math.log2(max(1, tp))

    def train_parallel(self, tp: int, max_seq: float) -> int:
        """Model-parallel degree a step really runs at: TP, or more when the longest sequence needs
        sequence parallelism to fit `train_tokens_per_gpu`."""
        need = max(1, math.ceil(max_seq / self.calib.train_tokens_per_gpu))
        return max(tp, 1 << (need - 1).bit_length())

    def train_flops(self, tokens: float, avg_seq: float, passes: int | None = None) -> float:
        """Forward + backward (two forwards' worth) + one forward for old log-probs (GRPO) + one
        recomputed forward when activations are checkpointed, with causal attention; or `passes`
        forwards' worth (a trainer measured doing fewer)."""
        if passes is None:
            passes = 4 + (1 if self.calib.activation_recompute else 0)
        per_token = 2 * passes * (self.model.active_params + self.model.layers * self.model.hidden * avg_seq)
        return per_token * tokens

    def train_step_s(
        self, tokens: float, avg_seq: float, gpus: int, tp: int = 1, max_seq: float = 0.0
    ) -> float:
        """Compute at the MFU of the real model-parallel degree, plus the data-parallel gradient
        all-reduce (ring: 2 (dp-1)/dp of the gradient shard over the inter-node network)."""
        if gpus <= 0:
            return math.inf
        mp = min(gpus, self.train_parallel(tp, max_seq))
        compute = self.train_flops(tokens, avg_seq) / (gpus * self.gpu.flops * self.train_mfu(mp))
        dp = max(1, gpus // mp)
        grads = 2 * (dp - 1) / dp * self.model.weight_bytes / mp / self.gpu.net_bw
        return self.calib.train * compute + grads

    def min_train_gpus(self) -> int:
        """GPUs needed to hold sharded training state with half of each GPU left for activations."""
        return max(
            1, math.ceil(self.model.params * self.train_state_bytes_per_param / (0.5 * self.gpu.mem_bytes))
        )

    def weight_sync_s(self, cross_node: bool = True, share: float = 1.0, copies: int = 1) -> float:
        """Trainer -> rollout engines push of the full bf16 weights (broadcast pipelined over the
        network), or `share` of them (a delta), plus the fixed coordination cost; `copies`: how
        many the trainer's uplink carries at once (a relay tree's roots; 1: a broadcast)."""
        bw = self.gpu.net_bw if cross_node else self.gpu.nvlink_bw
        return copies * share * self.model.weight_bytes / bw + self.calib.sync_fixed_s

    def engine_load_s(self, tp: int, share: float = 1.0, copies: int = 1) -> float:
        """An engine of `tp` GPUs receiving its weights, or `share` of them (a delta): each GPU
        takes its shard in parallel, at 1/`copies` of the link (the sender's other copies)."""
        return copies * share * self.model.weight_bytes / tp / self.gpu.net_bw + self.calib.sync_fixed_s

    def colocated_switch_s(self, gpus: int, rollout_tp: int) -> float:
        """One verl-style role switch on colocated GPUs: offload or onload the training state that
        does not fit beside the engine (gradients and optimizer moments, sharded over `gpus`),
        reshard the weights into the engine's TP layout over NVLink, sleep or wake the engine's
        weights over PCIe, plus the fixed cost."""
        state = self.model.params * (self.train_state_bytes_per_param - self.model.bytes_per_param) / gpus
        reshard = self.model.weight_bytes / rollout_tp / self.gpu.nvlink_bw
        engine_weights = self.model.weight_bytes / rollout_tp
        return (state + engine_weights) / self.gpu.pcie_bw + reshard + self.calib.colocate_fixed_s

    def kv_transfer_s(self, tokens: float, tp: int) -> float:
        """Moving a running sequence's KV cache of `tokens` tokens between engines of `tp` GPUs:
        each GPU sends its shard over its own NIC (RDMA), no recomputation."""
        bw = tp * self.gpu.net_bw * self.calib.kv_transfer_efficiency
        return tokens * self.model.kv_bytes_per_token / bw

    def state_fetch_s(self, train_gpus: int) -> float:
        """A joining data-parallel replica fetches weights plus its optimizer shard, then the
        data-parallel communicators are rebuilt."""
        shard = self.model.params * (self.train_state_bytes_per_param - 2) / max(1, train_gpus)
        return (self.model.weight_bytes + shard) / self.gpu.net_bw + self.calib.join_fixed_s

    def calibrate(self, profiles: Iterable[Profile]) -> Calibration:
        """Fit per-kind multipliers as the mean ratio measured/predicted; returns the new calibration."""
        ratios: dict[str, list[float]] = {"decode": [], "prefill": [], "train": []}
        base = Calibration(**{**asdict(self.calib), "decode": 1.0, "prefill": 1.0, "train": 1.0})
        raw = CostModel(self.gpu, self.model, base, self.train_state_bytes_per_param, self.reserved_fraction)
        for p in profiles:
            if p.kind == "decode":
                pred = raw.decode_step_s(p.batch, p.context, p.tp)
            elif p.kind == "prefill":
                pred = raw.prefill_s(p.tokens, p.context, p.tp)
            elif p.kind == "train":
                pred = raw.train_step_s(p.tokens, p.context, p.gpus, p.tp)
            else:
                raise ValueError(f"unknown profile kind {p.kind!r}")
            if pred > 0:
                ratios[p.kind].append(p.seconds / pred)
        for kind, rs in ratios.items():
            if rs:
                setattr(base, kind, sum(rs) / len(rs))
        self.calib = base
        return base


def preset_names() -> tuple[list[str], list[str]]:
    """(GPU presets, model presets) known to `load_presets`."""
    return list(_read_presets("hardware")), list(_read_presets("models"))


def gpu_preset(name: str) -> GPUSpec:
    """A GPU of `presets/hardware.yaml` by its key (`H200`) or its full name (`H200-141GB-SXM`)."""
    gpus = _read_presets("hardware")
    for key, spec in gpus.items():
        if name in (key, spec.get("name")):
            return GPUSpec.from_dict(spec)
    raise KeyError(f"unknown GPU preset {name!r}; known: {', '.join(gpus)}")


def _read_presets(kind: str) -> dict[str, Any]:
    with open(PRESET_DIR / f"{kind}.yaml") as f:
        data: dict[str, Any] = yaml.safe_load(f)
    return data


def load_profile(path: str | Path) -> CostModel:
    """The cost model of a profile `libra calibrate` wrote: the machine and model it measured,
    with the constants fitted to its measurements (tools/calibrate.py)."""
    with open(path) as f:
        data = yaml.safe_load(f)
    if not isinstance(data, dict) or data.get("libra_profile") != 1:
        raise ValueError(f"{path}: not a profile written by `libra calibrate`")
    known = {f.name for f in fields(Calibration)}
    calib = Calibration(**{k: v for k, v in (data.get("calibration") or {}).items() if k in known})
    return CostModel(GPUSpec.from_dict(data["gpu"]), ModelSpec.from_dict(data["model"]), calib)


TRANSFERABLE = ("mem_efficiency", "prefill_mfu", "train_mfu")
"""A profile's efficiencies that hold on other hardware of its kind: the shares of the peak its
kernels achieved. The decode overhead is its engine's (an eager `hf` engine's is not vLLM's)."""


def profile_efficiencies(path: str | Path) -> dict[str, float]:
    """The efficiencies a GPU profile measured against its preset's peak (`TRANSFERABLE`), to apply
    to another scenario's hardware (`libra sim --efficiencies`)."""
    with open(path) as f:
        data = yaml.safe_load(f)
    if not isinstance(data, dict) or data.get("libra_profile") != 1:
        raise ValueError(f"{path}: not a profile written by `libra calibrate`")
    eff = data.get("efficiency")
    if not eff:
        raise ValueError(f"{path}: measured on no known GPU preset, so it has no efficiencies against a peak")
    return {k: float(eff[k]) for k in TRANSFERABLE if eff.get(k) is not None}


def load_presets(gpu: str, model: str) -> CostModel:
    """The cost model of a named GPU and model from `presets/` (hardware.yaml, models.yaml)."""
    gpus, models = _read_presets("hardware"), _read_presets("models")
    if gpu not in gpus:
        raise KeyError(f"unknown GPU preset {gpu!r}; known: {', '.join(gpus)}")
    if model not in models:
        raise KeyError(f"unknown model preset {model!r}; known: {', '.join(models)}")
    return CostModel(GPUSpec.from_dict(gpus[gpu]), ModelSpec.from_dict(models[model]))

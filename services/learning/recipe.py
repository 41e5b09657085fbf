"""The job's model, optimizer and GRPO step, built from its `LearnJob`: the same on the trainer, on
every rank of a sharded trainer and on a hybrid engine's training side."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from services.common.models import check_reference, load_model, load_tokenizer
from services.common.runconfig import LearnJob
from services.learning.data import Sample
from services.learning.grpo import LossConfig
from services.learning.hybrid import Replica
from services.learning.step import StepSettings, StepStats, lr_at, train_step


def resolve_device(want: str) -> torch.device:
    """`auto`, `cpu` or `cuda` as a torch device; `cuda` without a GPU torch can see is an error."""
    if want == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if want == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("cuda asked, but torch sees no CUDA GPU (a CPU build of torch?)")
    return torch.device(want)


def compute_device(job: LearnJob) -> torch.device:
    """training.device as a torch device (`resolve_device`)."""
    try:
        return resolve_device(job.training.device)
    except RuntimeError as err:
        raise RuntimeError(f"training.device: {err}") from None


def uses_bf16(job: LearnJob, device: torch.device) -> bool:
    precision = job.training.precision
    return precision == "bf16" or (precision == "auto" and device.type == "cuda")


def optimizer_for(job: LearnJob, model: torch.nn.Module) -> torch.optim.Optimizer:
    t = job.training
    trainable = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters only
    return torch.optim.AdamW(trainable, lr=t.lr, betas=t.adam_betas, weight_decay=t.weight_decay)


def policy_model(job: LearnJob) -> Any:
    """The job's model as the trainer trains it (on the host; the caller moves or shards it), its
    activations recomputed as `recompute_activations` says."""
    model = load_model(job.model)
    if job.training.backend != "emulated":
        recompute_activations(job, model)
    return model


def recompute_activations(job: LearnJob, model: Any) -> bool:
    """With `training.gradient_checkpointing` (and a model that can), each decoder layer's
    activations are recomputed in the backward pass instead of kept (non-reentrant, so frozen
    inputs and LoRA need nothing more); True when they are."""
    if not (job.training.gradient_checkpointing and hasattr(model, "gradient_checkpointing_enable")):
        return False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return True


def reference_for(job: LearnJob, device: torch.device) -> torch.nn.Module | None:
    """The frozen policy a KL penalty pulls towards, when one is configured: training.reference_model,
    or the initial weights."""
    if job.training.kl_coef <= 0 or job.training.backend == "emulated":
        return None
    check_reference(job.model, job.training.reference_model)
    ref = load_model(job.training.reference_model or job.model).to(device)
    ref.eval()
    ref.requires_grad_(False)
    return ref


def step_settings(
    job: LearnJob,
    pad_id: int,
    version: int,
    step_index: int | None = None,
    device: torch.device | None = None,
) -> StepSettings:
    """The step's settings from the job config, the same on every rank of a hybrid group (their
    micro-batches must agree). `step_index` (rank 0) sets the scheduled learning rate."""
    t = job.training
    lr = None
    if step_index is not None:
        lr = lr_at(
            step_index,
            lr=t.lr,
            schedule=t.lr_schedule,
            warmup=t.lr_warmup_steps,
            total=t.steps,
            min_ratio=t.min_lr_ratio,
        )
    return StepSettings(
        loss=LossConfig(
            clip_eps=t.clip_eps,
            clip_eps_high=t.clip_eps_high,
            dual_clip=t.dual_clip,
            tis_cap=t.tis_cap,
            kl_coef=t.kl_coef,
            loss_agg=t.loss_agg,
            rollout_correction=t.rollout_correction,
        ),
        micro_batch=t.micro_batch,
        pad_id=pad_id,
        mini_batches=t.mini_batches,
        max_grad_norm=t.max_grad_norm,
        lr=lr,
        version=version,
        drop_zero_advantage=job.drop_zero_advantage,
        top_p=job.top_p,
        advantage=t.advantage,
        overlong_filter=job.overlong_filter,
        device=str(device or torch.device("cpu")),
        bf16=uses_bf16(job, device or torch.device("cpu")),
    )


def run_step(
    job: LearnJob,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    pad_id: int,
    samples: Sequence[Sample],
    version: int,
    should_abort: Callable[[], bool] = lambda: False,
    pg: Any = None,
    *,
    ref: torch.nn.Module | None = None,
    step_index: int | None = None,
) -> StepStats:
    """The job's GRPO step, the same on every rank of a hybrid group."""
    device = next(model.parameters()).device
    return train_step(
        model,
        optimizer,
        samples,
        step_settings(job, pad_id, version, step_index, device),
        should_abort=should_abort,
        dp_group=pg,
        ref_model=ref,
    )


def replica_for(job: LearnJob) -> Replica:
    """A hybrid worker's training side: the job's model (its weights come from the trainer when it
    joins a generation) and the trainer's step, without an optimizer (rank 0 alone steps)."""
    torch.set_num_threads(job.training.torch_threads)
    device = compute_device(job)
    model = policy_model(job).to(device)
    ref = reference_for(job, device)
    pad_id = int(load_tokenizer(job.model).pad_token_id)
    return Replica(
        model,
        lambda samples, pg, version: run_step(job, model, None, pad_id, samples, version, pg=pg, ref=ref),
    )

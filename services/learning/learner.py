"""The trainer's torch side: model, optimizer and bookkeeping, stepped and checkpointed as one unit.

Everything here is blocking and runs in a worker thread; the trainer service's shell owns all I/O
with NATS, Redis and the engines. Keeping the two apart is what lets `python -m services.trainer
--help` (and the shell's start-up) avoid importing torch.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from services.common.models import check_reference, load_model, load_tokenizer
from services.common.runconfig import LearnJob
from services.learning import checkpoint
from services.learning.advantages import informative
from services.learning.data import Sample, one_per_trajectory
from services.learning.fsdp import ShardedTrainer
from services.learning.hybrid import GroupBroken, TrainerGroup
from services.learning.lora import is_lora, merged_state
from services.learning.lora import wrap as wrap_lora
from services.learning.recipe import (
    compute_device,
    optimizer_for,
    policy_model,
    reference_for,
    run_step,
    step_settings,
)
from services.learning.snapshot import Snapshot, snapshot
from services.learning.step import StepAborted, StepStats


class Learner:
    def __init__(self, job: LearnJob, ckpt_dir: Path):
        torch.set_num_threads(job.training.torch_threads)
        self.job = job
        self.ckpt_dir = ckpt_dir
        self.tokenizer = load_tokenizer(job.model)
        self.device = compute_device(job)
        self.sharded: ShardedTrainer | None = None
        """FSDP ranks (training.fsdp > 1): model, optimizer and reference are this rank's shards."""
        self.model: Any
        self.optimizer: torch.optim.Optimizer
        self.ref: torch.nn.Module | None
        """The frozen reference policy of the KL penalty (None without training.kl_coef)."""
        if job.training.fsdp > 1 and job.training.backend != "emulated":
            check_reference(job.model, job.training.reference_model)
            self.sharded = ShardedTrainer(job)
            self.model = self.sharded.model
            self.optimizer = self.sharded.shards.optimizer
            self.ref = self.sharded.shards.ref
        else:
            self.model = self._fresh_model()
            self.optimizer = optimizer_for(job, self.model)
            self.ref = reference_for(job, self.device)
        self.state = checkpoint.TrainerState()
        self.loaded: Path | None = None
        """The checkpoint the weights in memory are (None: the initial weights)."""
        self.optimizer_from: Path | None = None
        """The checkpoint the optimizer state was last restored from: `loaded` when it is full, an
        earlier full one when `loaded` holds the weights only, None when it was fresh."""
        self.vocab_size = int(self.model.get_input_embeddings().num_embeddings)
        self.pad_id = int(self.tokenizer.pad_token_id)
        self.group_error = ""
        """Why the last step's hybrid group broke ('' when it did not)."""

    def _fresh_model(self) -> Any:
        """The initial policy on this trainer's device; with training.lora, wrapped in its adapters."""
        model = policy_model(self.job).to(self.device)
        lora = self.job.training.lora
        if lora is not None and self.job.training.backend != "emulated":
            return wrap_lora(model, lora)
        return model

    def _plain_state(self) -> dict[str, Any]:
        """The policy's weights under the plain model's names (LoRA: merged), as engines load them."""
        if is_lora(self.model):
            return merged_state(self.model)
        return self._full_state(optimizer=False)[0]

    def close(self) -> None:
        """Stops the FSDP ranks, if any (the trainer's job ended)."""
        if self.sharded is not None:
            self.sharded.close()

    def resume(self) -> Path | None:
        path = checkpoint.latest(self.ckpt_dir)
        if path is not None:
            self.state = self._restore(path)
            self.loaded = path
        return path

    def _restore(self, path: Path) -> checkpoint.TrainerState:
        """Loads a checkpoint's weights and bookkeeping, with the optimizer state of the newest full
        checkpoint at or before it (a fresh optimizer when none is left)."""
        payload, source = checkpoint.read_resumable(path)
        self.optimizer_from = source
        fresh = payload.get("optimizer") is None
        if self.sharded is not None:
            self.sharded.load(payload, reset_optimizer=fresh)
            self.optimizer = self.sharded.shards.optimizer
        else:
            self.model.load_state_dict(payload["model"])
            if fresh:
                self.optimizer = optimizer_for(self.job, self.model)
            else:
                self.optimizer.load_state_dict(payload["optimizer"])
        return checkpoint.state_of(payload)

    def _full_state(self, optimizer: bool = True) -> tuple[dict[str, Any], dict[str, Any]]:
        """The model's (and optimizer's) full state, as a checkpoint keeps it."""
        if self.sharded is not None:
            return self.sharded.full_state(optimizer)
        return self.model.state_dict(), self.optimizer.state_dict() if optimizer else {}

    def rollback(self, committed_step: int, committed_path: str = "") -> Path | None:
        """Returns to the last committed step: checkpoints past it (written, then refused by the
        fenced commit, or left by a trainer that lost its lease) and other epochs' files at that
        step are deleted, and the committed checkpoint is loaded (the one the commit record names,
        else the newest left), or the initial weights when there is none. A standby taking over
        uses the same path to load its predecessor's last committed step."""
        named = Path(committed_path) if committed_path else None
        if named is not None and not named.exists():
            named = None
        for path in checkpoint.checkpoints(self.ckpt_dir):
            step = checkpoint.step_of(path)
            if step > committed_step or (named is not None and step == committed_step and path != named):
                path.unlink(missing_ok=True)
        found = named or checkpoint.latest(self.ckpt_dir)
        if found is not None:
            self.state = self._restore(found)
        elif self.sharded is not None:
            self.sharded.load({"model": load_model(self.job.model).state_dict()}, reset_optimizer=True)
            self.optimizer = self.sharded.shards.optimizer
            self.state = checkpoint.TrainerState()
        else:
            self.model = self._fresh_model()
            self.optimizer = optimizer_for(self.job, self.model)
            self.state = checkpoint.TrainerState()
        self.loaded = found
        return found

    def step(
        self,
        samples: Sequence[Sample],
        should_abort: Callable[[], bool] = lambda: False,
        group: TrainerGroup | None = None,
    ) -> StepStats:
        """Updates the weights in memory; nothing is durable until `commit`. With a hybrid group
        its replicas compute their share of the gradients; if the group breaks the step is computed
        again here alone (the failure is in `group_error`)."""
        self.group_error = ""
        if self.job.training.backend == "emulated":
            return self.emulated_step(samples, should_abort)
        if self.sharded is not None:
            settings = step_settings(self.job, self.pad_id, self.state.version, self.state.step, self.device)
            stats: StepStats = self.sharded.call("step", (list(samples), settings))
            return dataclasses.replace(stats, data_parallel=self.sharded.world)
        if group is not None and group.pg is not None:
            world = group.world
            try:
                stats = group.run_step(
                    samples, lambda pg: self._train(samples, should_abort, pg), self.model, self.state.version
                )
                return dataclasses.replace(stats, data_parallel=world)
            except GroupBroken as err:
                self.group_error = str(err)
        return self._train(samples, should_abort)

    def _train(
        self, samples: Sequence[Sample], should_abort: Callable[[], bool], pg: Any = None
    ) -> StepStats:
        return run_step(
            self.job,
            self.model,
            self.optimizer,
            self.pad_id,
            samples,
            self.state.version,
            should_abort,
            pg,
            ref=self.ref,
            step_index=self.state.step,
        )

    def emulated_step(self, samples: Sequence[Sample], should_abort: Callable[[], bool]) -> StepStats:
        """EMULATED: waits what the cost model says the step takes on the emulated GPUs (their
        compute at the real model-parallel degree plus the gradient all-reduce) and changes no weight."""
        t, e = self.job.training, self.job.emulated
        cm = e.costs()
        lengths = [len(s.input_ids) for s in samples] or [0]
        tokens = sum(lengths)
        seconds = cm.train_step_s(tokens, tokens / len(lengths), t.emulated_gpus, t.emulated_tp, max(lengths))
        deadline = time.monotonic() + seconds * e.time_scale
        while (left := deadline - time.monotonic()) > 0:
            if should_abort():
                raise StepAborted("emulated step abandoned")
            time.sleep(min(left, 0.1))
        members = one_per_trajectory(samples)
        rewards = [s.reward for s in members] or [0.0]
        by_group: dict[str, list[float]] = {}
        for s in members:
            by_group.setdefault(s.group_id, []).append(s.reward)
        return StepStats(
            loss=0.0,
            tokens=sum(s.num_generated for s in samples),
            trajectories=len(members),
            reward_mean=statistics.fmean(rewards),
            reward_std=statistics.pstdev(rewards),
            kl=0.0,
            clip_fraction=0.0,
            ratio_mean=1.0,
            grad_norm=0.0,
            seconds=seconds * e.time_scale,
            trained_groups=sum(informative(r) for r in by_group.values()),
        )

    def commit(self, trajectory_ids: set[str], epoch: int = 0) -> Path:
        """Advances version and step, records the ids that produced them and writes the checkpoint
        under this trainer's epoch (its fencing token)."""
        s, t = self.state, self.job.training
        new = checkpoint.TrainerState(s.step + 1, s.version + 1, s.trained_ids | trajectory_ids)
        full = new.step % t.checkpoint_every == 0 or new.step >= t.steps
        model_state, optimizer_state = self._full_state(optimizer=full)
        path = checkpoint.save(
            self.ckpt_dir,
            new,
            model_state,
            optimizer_state if full else None,
            keep=t.keep_checkpoints,
            epoch=epoch,
        )
        self.state, self.loaded = new, path
        return path

    def save_policy(self, run_id: str) -> Path:
        """The committed weights in Hugging Face format under <checkpoint_dir>/hf/step_<n>."""
        s = self.state
        meta = {
            "run_id": run_id,
            "step": s.step,
            "weight_version": s.version,
            "model_source": self.job.model.source,
        }
        out = self.ckpt_dir / "hf" / f"step_{s.step:08d}"
        out.parent.mkdir(parents=True, exist_ok=True)
        if self.sharded is None and not is_lora(self.model):
            return checkpoint.save_policy(self.model, self.tokenizer, out, meta)
        plain = load_model(self.job.model)  # the full weights, in the model's own class, on the host
        plain.load_state_dict(self._plain_state())
        adapter = self.model if is_lora(self.model) else None
        return checkpoint.save_policy(plain, self.tokenizer, out, meta, adapter=adapter)

    def snapshot(self) -> Snapshot:
        """The current weights for the wire (`training.push_dtype`). EMULATED end to end (emulated
        training and engines): neither side has real weights (the step changes none, the engines
        keep none), so the push carries a stand-in of a few bytes through the real path (header,
        records, checksums, fencing) and the engines stall for the cost model's load time of the
        model they pretend to serve; pushing the stand-in model instead would add its real
        transfer time, scaled up by `1 / time_scale`, to every step."""
        version = self.state.version
        if self.job.training.backend == "emulated" and self.job.rollout_backend == "emulated":
            return snapshot({"emulated.version": torch.tensor([float(version)])}, version)
        dtype = self.job.training.push_dtype
        return snapshot(self._plain_state(), version, None if dtype == "auto" else dtype)

"""FSDP: the policy sharded over `training.fsdp` local processes, for models whose weights, gradients
and optimizer state do not fit one GPU.

The trainer process is rank 0; it starts the other ranks as child processes (one GPU each on CUDA,
NCCL for the tensors; gloo on the CPU, where the tests run it) that die with it. Every rank loads
the model, shards each decoder layer and the root with FSDP2 (`fully_shard`) and keeps its own
shard of the optimizer state. Rank 0 drives: it broadcasts each operation (a step with its samples
and settings, a gather of the full state, a load of a checkpoint or of the initial weights) on a
gloo control group, then takes part
in it itself, so every rank runs the same collectives in the same order. A step deals the
micro-batches out as hybrid data parallelism does, with padding passes of weight zero so that every
rank runs as many forward and backward passes (FSDP's all-gathers and reduce-scatters are
collectives). Checkpoints stay one full file written by rank 0, in the format an unsharded trainer
writes, so a run can resume, roll back, export and push exactly as before.

Not yet: a step cannot be abandoned half-way (a shutdown waits for it), hybrid workers cannot join
a sharded step, and every rank reads the full weights into host memory before sharding.
"""

from __future__ import annotations

import dataclasses
import datetime
import multiprocessing
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from services.common.models import load_model
from services.common.runconfig import LearnJob
from services.learning.checkpoint import optimizer_state_by_index, optimizer_state_by_name
from services.learning.recipe import compute_device, optimizer_for, policy_model
from services.learning.step import train_step

CONTROL_TIMEOUT = datetime.timedelta(days=7)
"""Ranks wait for rank 0's next operation on the control group for as long as a rollout takes."""
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=30)


class ShardFailure(RuntimeError):
    """A rank of the sharded trainer died or could not start."""


@dataclass
class Shards:
    """What every rank holds: its shard of the policy, of the optimizer state and of the reference."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    ref: torch.nn.Module | None
    names: list[str]
    """The policy's parameter names in the optimizer's order (checkpoint format)."""
    tied: dict[str, str]
    """State-dict entries that are another entry's tensor (a head tied to the embeddings), which
    the gathered state must share again, as the unsharded model's state dict does."""


def rank_device(job: LearnJob, rank: int) -> torch.device:
    device = compute_device(job)
    return torch.device("cuda", rank) if device.type == "cuda" else device


def shard(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """FSDP2 on each block Hugging Face keeps whole (`_no_split_modules`: the decoder layers), then
    on the root (embeddings, norm, head); the weights move to `device` shard by shard."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    blocks = set(getattr(model, "_no_split_modules", None) or [])
    for module in model.modules():
        if type(module).__name__ in blocks:
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def build(job: LearnJob, device: torch.device) -> Shards:
    model = policy_model(job)
    names = [n for n, p in model.named_parameters()]
    first: dict[int, str] = {}
    tied = {}
    for name, t in model.state_dict(keep_vars=True).items():
        owner = first.setdefault(id(t), name)
        if owner != name:
            tied[name] = owner
    shard(model, device)
    ref = None
    if job.training.kl_coef > 0:
        ref = shard(load_model(job.training.reference_model or job.model), device)
        ref.eval()
        ref.requires_grad_(False)
    return Shards(model, optimizer_for(job, model), ref, names, tied)


def _full_state(shards: Shards, optimizer: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """The full (unsharded) state on rank 0's host, empty on the other ranks."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model = get_model_state_dict(shards.model, options=options)
    for name, owner in shards.tied.items():
        if owner in model:
            model[name] = model[owner]
    if not optimizer:
        return model, {}
    optim = get_optimizer_state_dict(shards.model, shards.optimizer, options=options)
    return model, optimizer_state_by_index(optim, shards.names) if optim else {}


def _load(shards: Shards, payload: dict[str, Any] | None, reset_optimizer: bool, job: LearnJob) -> None:
    """Rank 0's `payload` (model and, unless `reset_optimizer`, optimizer state) into every rank's
    shard; the other ranks pass None."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    payload = payload or {}
    set_model_state_dict(shards.model, payload.get("model", {}), options=options)
    shards.optimizer = optimizer_for(job, shards.model)
    if not reset_optimizer:
        optim = payload.get("optimizer")
        named = optimizer_state_by_name(optim, shards.names) if optim else {}
        set_optimizer_state_dict(shards.model, shards.optimizer, named, options=options)


def _perform(shards: Shards, job: LearnJob, op: str, arg: Any, payload: dict[str, Any] | None = None) -> Any:
    """One operation, run by every rank in the same order (`payload`: rank 0's data)."""
    if op == "step":
        samples, settings = arg
        device = rank_device(job, dist.get_rank())  # rank 0 named its own device
        settings = dataclasses.replace(settings, device=str(device), sharded=True)
        group = dist.distributed_c10d._get_default_group()
        return train_step(
            shards.model, shards.optimizer, samples, settings, dp_group=group, ref_model=shards.ref
        )
    if op == "full_state":
        return _full_state(shards, optimizer=bool(arg))
    if op == "load":
        return _load(shards, payload, reset_optimizer=bool(arg), job=job)
    raise ValueError(f"unknown sharded operation {op!r}")


def _init(rank: int, world: int, port: int, device: torch.device) -> Any:
    """Joins the process group (rank 0 hosts its store) and returns the control group."""
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=COLLECTIVE_TIMEOUT)
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT)
    return dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)


def _rank_main(rank: int, world: int, port: int, job_json: str) -> None:
    """A rank > 0: builds its shards, then performs what rank 0 broadcasts until told to stop."""
    from services.common.localstack import die_with_parent

    die_with_parent()
    job = LearnJob.from_json(job_json)
    torch.set_num_threads(job.training.torch_threads)
    device = rank_device(job, rank)
    control = _init(rank, world, port, device)
    shards = build(job, device)
    try:
        while True:
            box: list[Any] = [None, None]
            dist.broadcast_object_list(box, src=0, group=control)
            op, arg = box
            if op == "stop":
                break
            _perform(shards, job, op, arg)
    finally:
        dist.destroy_process_group()


class ShardedTrainer:
    """Rank 0's side: starts the other ranks and runs each operation on all of them.

    Operations come from the trainer's worker threads (a step, a push's snapshot, a policy save);
    one runs at a time: two interleaved would broadcast their ops and run their collectives in
    different orders on different ranks, and the ranks would read each other's tensors."""

    def __init__(self, job: LearnJob):
        from services.common.localstack import free_port

        self._one_at_a_time = threading.Lock()
        self.job = job
        self.world = job.training.fsdp
        self.closed = True
        self.procs: list[Any] = []
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if rank_device(job, 0).type == "cuda" and gpus < self.world:
            raise ShardFailure(f"training.fsdp is {self.world} but torch sees {gpus} CUDA GPU(s)")
        port = free_port()
        ctx = multiprocessing.get_context("spawn")
        self.procs = [
            ctx.Process(
                target=_rank_main,
                args=(rank, self.world, port, job.to_json()),
                name=f"libra-fsdp-rank{rank}",
                daemon=True,
            )
            for rank in range(1, self.world)
        ]
        for p in self.procs:
            p.start()
        self.device = rank_device(job, 0)
        try:
            self.control = _init(0, self.world, port, self.device)
        except Exception as err:  # a rank that died before joining
            self.close()
            raise ShardFailure(f"the {self.world} FSDP ranks did not form a group: {err}") from err
        self.closed = False
        self.shards = build(job, self.device)

    def _check(self) -> None:
        dead = [(p.name, p.exitcode) for p in self.procs if not p.is_alive()]
        if dead:
            raise ShardFailure(f"FSDP rank(s) died: {', '.join(f'{n} (exit {c})' for n, c in dead)}")

    def call(self, op: str, arg: Any = None, payload: dict[str, Any] | None = None) -> Any:
        """Broadcasts `op` to every rank and performs it here too; rank 0's result."""
        with self._one_at_a_time:
            self._check()
            try:
                dist.broadcast_object_list([op, arg], src=0, group=self.control)
                return _perform(self.shards, self.job, op, arg, payload)
            except RuntimeError:  # a collective broke because a rank died: say which, and how
                for p in self.procs:
                    p.join(timeout=2)
                self._check()
                raise

    @property
    def model(self) -> torch.nn.Module:
        return self.shards.model

    def full_state(self, optimizer: bool = True) -> tuple[dict[str, Any], dict[str, Any]]:
        result: tuple[dict[str, Any], dict[str, Any]] = self.call("full_state", optimizer)
        return result

    def load(self, payload: dict[str, Any], reset_optimizer: bool = False) -> None:
        self.call("load", reset_optimizer, payload)

    def close(self) -> None:
        """Stops the other ranks and leaves the process group (a new job forms a new one)."""
        with self._one_at_a_time:
            self._close()

    def _close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                if all(p.is_alive() for p in self.procs):
                    dist.broadcast_object_list(["stop", None], src=0, group=self.control)
            finally:
                dist.destroy_process_group()
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()

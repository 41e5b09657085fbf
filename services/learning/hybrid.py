"""The hybrid pool's data-parallel group: rank 0 is the trainer, ranks 1.. are engines the planner
moved into training. Blocking (torch.distributed, gloo): both sides call this from a worker thread.

Each generation of the group is a `ProcessGroupGloo` of its own, met through a `TCPStore` the
trainer hosts (keys prefixed by the generation), so members join and leave by forming a new
generation at a step boundary; nothing else in either process uses torch.distributed. Over a
generation the trainer leads and the replicas follow:

- at formation it broadcasts its weights (the replica's "fetch state": a replica contributes
  gradients only, so weights are all it needs; rank 0 alone holds the optimizer and steps);
- `STEP`: a header, then the step's samples and start version (JSON), then every rank runs
  `train_step` on its share of the micro-batches with the group (with several mini-batches, rank 0
  broadcasts its weights after each update but the last), and rank 0 broadcasts the updated weights;
- `PING` while the trainer waits for data, so a replica's wait stays within the op timeout and a
  dead trainer is noticed within it;
- `CLOSE` ends the generation (someone joins or leaves; the trainer stops).

Any failure (a member killed or cut off) breaks the generation on every rank: the trainer re-runs
the step alone (nothing was applied: the optimizer steps after the gradient sum) and goes on; the
replica goes back to asking for a place. The rendezvous store has no authentication of its own (it
belongs on the cluster network, like NCCL's), but each generation meets under a fresh secret key
that only its members are told (`HybridGroup.rendezvous_key`): a process that reaches the port
without it cannot take a rank.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import secrets
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist

from services.learning.data import Sample

CMD_STEP, CMD_PING, CMD_CLOSE = 1, 2, 3
_COMMANDS = {CMD_STEP: "step", CMD_PING: "ping", CMD_CLOSE: "close"}
MAX_PAYLOAD = 256 << 20
"""Largest samples payload a replica accepts (a step of 512 trajectories of 64k tokens is ~200 MB)."""


class GroupBroken(RuntimeError):
    """The generation failed on this rank (a peer died, timed out or sent nonsense)."""


def _timeout(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def _params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _form(store: Any, generation: int, key: str, rank: int, world: int, timeout_s: float) -> Any:
    prefix = dist.PrefixStore(f"libra/gen{generation}/{key}/", store)
    try:
        return dist.ProcessGroupGloo(prefix, rank, world, _timeout(timeout_s))
    except RuntimeError as err:
        raise GroupBroken(f"generation {generation} did not form: {err}") from err


def _broadcast(pg: Any, t: torch.Tensor) -> torch.Tensor:
    try:
        pg.broadcast(t, 0).wait()
    except RuntimeError as err:
        raise GroupBroken(str(err)) from err
    return t


def broadcast_weights(pg: Any, model: torch.nn.Module) -> int:
    """Rank 0's trainable weights to every rank, as one float32 buffer; returns its bytes."""
    params = _params(model)
    with torch.no_grad():
        if pg.rank() == 0:
            flat = torch.cat([p.detach().float().reshape(-1) for p in params])
        else:
            flat = torch.empty(sum(p.numel() for p in params), dtype=torch.float32)
        _broadcast(pg, flat)
        if pg.rank() != 0:
            offset = 0
            for p in params:
                p.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
    return flat.numel() * 4


def _encode(samples: Sequence[Sample], version: int) -> torch.Tensor:
    data = json.dumps(
        {"version": version, "samples": [asdict(s) for s in samples]}, separators=(",", ":")
    ).encode()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _decode(buf: torch.Tensor) -> tuple[list[Sample], int]:
    data = json.loads(bytes(buf.numpy()))
    return [Sample(**r) for r in data["samples"]], int(data["version"])


class TrainerGroup:
    """Rank 0: hosts the rendezvous, forms generations, leads every command."""

    def __init__(self, host: str, port: int, timeout_s: float):
        self.timeout_s = timeout_s
        self.store = dist.TCPStore(
            host, port, is_master=True, wait_for_workers=False, timeout=_timeout(timeout_s)
        )
        self.port = int(self.store.port)
        self.generation = 0
        self.members: list[str] = []
        self.tokens: list[int] = []
        self.key = ""
        """The current generation's rendezvous secret (told to its members only)."""
        self.pg: Any = None

    @property
    def world(self) -> int:
        return 1 + len(self.members) if self.pg is not None else 1

    def next_generation(self, members: list[str], tokens: list[int]) -> int:
        """Announces a new generation (the caller publishes it); `form` then meets its members."""
        self.generation += 1
        self.members, self.tokens = list(members), list(tokens)
        self.key = secrets.token_hex(16)
        return self.generation

    def form(self, model: torch.nn.Module) -> int:
        """Meets this generation's members and sends them the weights; raises GroupBroken (and
        holds no group) when one does not come within the timeout."""
        try:
            self.pg = _form(self.store, self.generation, self.key, 0, 1 + len(self.members), self.timeout_s)
            return broadcast_weights(self.pg, model)
        except GroupBroken:
            self.drop()
            raise

    def _command(self, cmd: int, payload: torch.Tensor | None = None) -> None:
        size = 0 if payload is None else payload.numel()
        _broadcast(self.pg, torch.tensor([cmd, size], dtype=torch.int64))
        if payload is not None and size:
            _broadcast(self.pg, payload)

    def run_step(
        self, samples: Sequence[Sample], step: Callable[[Any], Any], model: torch.nn.Module, version: int
    ) -> Any:
        """Sends the samples and the version the step starts from, runs `step(pg)` with the
        replicas and sends them the result. A broken generation is dropped; the caller re-runs the
        step alone (GroupBroken is raised before the optimizer steps when the gradient sum fails)."""
        try:
            self._command(CMD_STEP, _encode(samples, version))
            result = step(self.pg)
        except (GroupBroken, RuntimeError) as err:
            self.drop()
            raise GroupBroken(str(err)) from err
        try:
            broadcast_weights(self.pg, model)
        except GroupBroken:
            self.drop()  # the step itself is done; the replicas will not be in the next one
        return result

    def ping(self) -> None:
        try:
            self._command(CMD_PING)
        except GroupBroken:
            self.drop()
            raise

    def close(self) -> None:
        """Ends the generation on every member (best effort: a dead one is gone anyway)."""
        if self.pg is not None:
            with contextlib.suppress(GroupBroken):
                self._command(CMD_CLOSE)
        self.drop()

    def drop(self) -> None:
        self.pg = None
        self.members, self.tokens = [], []


class Replica:
    """Rank i > 0: a worker's training side while it is in the hybrid pool."""

    def __init__(self, model: torch.nn.Module, step: Callable[[Sequence[Sample], Any, int], Any]):
        self.model = model
        self.step = step
        self.steps = 0

    def serve(
        self,
        host: str,
        port: int,
        generation: int,
        key: str,
        rank: int,
        world: int,
        timeout_s: float,
        on_joined: Callable[[float], None] = lambda _: None,
    ) -> str:
        """Joins one generation and follows it until the trainer closes it ("closed") or it
        breaks (raises GroupBroken). `on_joined(bytes)` is called once the weights are here."""
        try:
            store = dist.TCPStore(host, port, is_master=False, timeout=_timeout(timeout_s))
        except RuntimeError as err:
            raise GroupBroken(f"no rendezvous at {host}:{port}: {err}") from err
        pg = _form(store, generation, key, rank, world, timeout_s)
        on_joined(broadcast_weights(pg, self.model))
        while True:
            header = _broadcast(pg, torch.zeros(2, dtype=torch.int64)).tolist()
            cmd, size = int(header[0]), int(header[1])
            if cmd == CMD_CLOSE:
                return "closed"
            if cmd == CMD_PING:
                continue
            if cmd != CMD_STEP or not 0 < size <= MAX_PAYLOAD:
                raise GroupBroken(f"unexpected command {header} from the trainer")
            samples, version = _decode(_broadcast(pg, torch.empty(size, dtype=torch.uint8)))
            try:
                self.step(samples, pg, version)
            except RuntimeError as err:
                raise GroupBroken(f"step failed: {err}") from err
            broadcast_weights(pg, self.model)
            self.steps += 1

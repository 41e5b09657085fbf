"""The trainer serving lent turns itself (planner.lending.trainer_serves): its own engine.

While the trainer waits for its batch it asks the planner to lend its GPUs (`services/trainer/
lending.py`); with `trainer_serves` the lent engine is this process: a `TurnServer` on an
`HFBackend` over the learner's own model, so it serves the weights the trainer trained last with no
copy and no push. It is the worker `<trainer's id>-engine` (kind `trainer`, on a NATS connection of
its own under the trainer's identity, which may speak for that worker and read its turn requests
only): the planner parks it at start, lends it (`lent`, the lending bucket) and parks it again when
the trainer takes its GPUs back — then it hands its turns back with the tokens they have, as any
drained engine does, and they continue on other engines. The trainer trains only inside
`training()`, which hands back whatever is still held and keeps the engine from stepping until the
step is done, whatever the plan says (a planner that does not answer must not stop training).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from services.common import subjects
from services.common.bus import Bus
from services.common.config import CommonSettings
from services.common.contracts import ev
from services.common.credentials import trainer_engine_id
from services.common.membership import LENT_ROLE, Membership
from services.common.ownership import OwnershipStore
from services.common.runconfig import EngineJob
from services.generation.backends.hf import HFBackend
from services.generation.config import EngineSettings
from services.generation.engine import ContinuousEngine
from services.generation.serving import TurnServer

if TYPE_CHECKING:
    from services.learning.learner import Learner


class TrainerEngine(TurnServer):
    def __init__(
        self,
        common: CommonSettings,
        job: EngineJob,
        lend: tuple[str, int],
        learner: Learner,
        store: OwnershipStore,
        trainer_id: str,
    ):
        self.learner = learner
        backend = HFBackend(job.model, job.rollout.torch_threads, model=learner.model)
        super().__init__(trainer_engine_id(trainer_id), EngineSettings(), job, backend, "trainer")
        self.backend: HFBackend = backend
        assert isinstance(self.engine, ContinuousEngine)  # an hf backend is stepped by the batcher
        self.batcher: ContinuousEngine = self.engine
        self.common, self.store = common, store
        self.lend_bucket, self.lend_tp = lend
        """Where and at which TP it serves when lent, unless its assignment says where (the job's
        lending bucket, planner.lending.tensor_parallel)."""
        self.draining = True  # parked until the planner lends it
        self._training = False

    @property
    def bucket(self) -> str:
        a = self.membership.assignment
        return a.bucket if a is not None and a.bucket else self.lend_bucket

    @property
    def tensor_parallel(self) -> int:
        return self.lend_tp

    def holds_lease(self) -> bool:
        return self.membership.holds_lease()

    async def start(self) -> None:
        """Opens its own connection, announces itself as the trainer's engine and takes turns
        (refusing them while it is parked)."""
        await self.backend.start()
        self.engine.start()
        self.bus = await Bus.connect(
            self.common.nats_url,
            self.common.run_id,
            "trainer",
            self.worker_id,
            self.common.nats_auth(),
            self.common.nats_tls(),
        )
        hello = ev.WorkerHello(
            worker_id=self.worker_id,
            kind="trainer",
            tensor_parallel=self.tensor_parallel,
            trainer_engine=True,
        )
        self.membership = Membership(self.bus, self.store, hello, on_plan=self._on_plan)
        await self.membership.start()
        await self.open_turns()
        self.log.info("trainer_engine_ready", worker_id=self.worker_id, bucket=self.bucket)

    async def _on_plan(self, plan: ev.Plan) -> None:
        a = self.membership.assignment
        if a is not None and a.role == LENT_ROLE and self.draining:
            async with self.batcher.exclusive():  # the learner's model as it is now, for serving
                self.backend.model = self.learner.model  # (a roll-back gives the learner a new one)
                self.learner.model.eval()
            await self.batcher.adopt(self.learner.state.version)
            self.draining = False
            self.log.info("trainer_engine_lent", bucket=a.bucket, policy_version=self.engine.version)
        elif (a is None or a.role != LENT_ROLE) and not self.draining:
            start = time.monotonic()
            handed_back = await self._drain()
            self.log.info("trainer_engine_parked", handed_back=handed_back, answered=self.turns_answered)
            if a is not None:  # the role change's step, as any engine parked says it (its cost)
                with contextlib.suppress(Exception):
                    await self.bus.publish(
                        subjects.HYBRID_STATE,
                        ev.HybridState(
                            worker_id=self.worker_id,
                            state=a.role,
                            fencing_token=a.fencing_token,
                            seconds=time.monotonic() - start,
                            turns_handed_back=handed_back,
                        ),
                    )

    @contextlib.asynccontextmanager
    async def training(self) -> AsyncIterator[None]:
        """The trainer's step, or a roll-back of its weights: no turn is served meanwhile (any
        still held is handed back with its tokens) and the model is the learner's alone. Re-entrant
        (a step that rolls back holds it already)."""
        if self._training:
            yield
            return
        self._training = True
        try:
            if not self.draining:
                await self._drain()
            async with self.batcher.exclusive():
                yield
        finally:
            self._training = False

    async def shutdown(self, grace_s: float = 4.0) -> None:
        await self.close_turns(grace_s)
        if hasattr(self, "membership"):
            await self.membership.release()
        if hasattr(self, "bus"):
            await self.bus.close()
        await self.backend.close()

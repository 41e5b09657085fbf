"""The engines' host, where engines (and a live job's trainer) share it: on a CPU host their
processes take the same cores, so each runs slower beside the others busy
(`Calibration.host_sharing`, measured by `libra calibrate` and by `libra bench live`). On GPUs
each engine has its own: `host_sharing` is 0 and nothing here runs."""

from __future__ import annotations

from services.simulation.engine import Engine
from services.simulation.kernel import Kernel


class SharedHost:
    def __init__(self, sim: Kernel, sharing: float, trainer_on_host: bool) -> None:
        """`sharing`: how much each busy neighbour slows a process; `trainer_on_host`: a trainer
        stepping counts as one (`SystemConfig.trainer_on_host`)."""
        self.sim, self.sharing, self.trainer_on_host = sim, sharing, trainer_on_host

    def busy_engines(self) -> list[Engine]:
        return [e for e in self.sim.engines.values() if e.n]

    def pace(self, neighbours: int) -> float:
        """How much slower work on the host runs beside `neighbours` other busy processes than
        alone (`sharing` each)."""
        return 1.0 + self.sharing * neighbours

    def share(self) -> None:
        """Each busy engine's iterations cost 1 + sharing x the other busy engines (and a trainer
        stepping) as much as alone, from now on."""
        if not self.sharing:
            return
        sim = self.sim
        busy = self.busy_engines()
        trainer = 1 if self.trainer_on_host and sim.training.busy else 0
        pace = self.pace(len(busy) - 1 + trainer)
        for e in busy:
            if e.pace != pace:
                e.set_pace(sim.now, pace)
                sim.wake(e)

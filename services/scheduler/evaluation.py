"""Held-out evaluation (`eval` in the run config): the policy is scored on prompts the run never
trains on, `eval.samples` samples each (pass@k for each k of `eval.pass_at_k`), before the first
step, every `eval.every` steps and after the last.

An evaluation round runs through the same engines, tools, environment and reward as training, at
the weights the engines serve once they hold the round's version (a turn waits for them); its
trajectories are never sent to the trainer and are not counted as the run's completed
trajectories. Rounds are asynchronous like everything else here: training does not wait for them,
so a round's later turns can run on a newer version — each round records the versions that
generated its tokens. A finished round's summary is kept in Redis (the ledger), so a restarted
scheduler does not run it again and the report reads it from there.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from services.common.runconfig import EvalConfig, TaskConfig
from services.scheduler.task import Task

EVAL_PREFIX = "eval-"


def is_eval(trajectory_id: str) -> bool:
    return trajectory_id.startswith(EVAL_PREFIX)


def eval_tasks(ev: EvalConfig, task: TaskConfig) -> list[Task]:
    """The held-out prompts: `ev.dataset`, or `task`'s own generator with `ev.seed` minus every
    prompt the run trains on; each with an `eval-` prompt id."""
    from services.scheduler.feed import task_list

    dataset = ev.dataset if ev.dataset is not None else task.dataset
    if isinstance(dataset, str):
        trained = {t.question for t in task_list(task)} if ev.dataset is None else set()
        spec = TaskConfig(
            dataset=dataset, num_prompts=min(1_000_000, 4 * ev.prompts + len(trained)), seed=ev.seed
        )
        tasks = [t for t in task_list(spec) if t.question not in trained][: ev.prompts]
    else:
        tasks = task_list(TaskConfig(dataset=dataset, num_prompts=ev.prompts))
    if not tasks:
        raise ValueError("eval: no held-out prompt is left once the training prompts are removed")
    return [dataclasses.replace(t, prompt_id=f"{EVAL_PREFIX}{t.prompt_id}") for t in tasks]


def targets(every: int, steps: int) -> list[int]:
    """The policy versions evaluated: 0, every, 2·every, … and the last."""
    if every <= 0:
        return []
    return sorted({*range(0, steps + 1, every), steps})


def pass_at_k(n: int, c: int, k: int) -> float:
    """The chance that at least one of k samples drawn without replacement from n, of which c
    pass, passes: 1 - C(n - c, k) / C(n, k) (Chen et al. 2021's unbiased estimator)."""
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs 1 <= k <= n = {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclass
class Round:
    version: int
    """The policy version the round evaluates (its turns wait for engines that hold it)."""
    total: int
    nonce: str
    """Per launch, so a relaunched round's ids never meet a lost launch's on an engine."""
    samples: int = 1
    """Samples per prompt: trajectory i is sample i % samples of prompt i // samples."""
    ks: tuple[int, ...] = (1,)
    threshold: float = 1.0
    """A sample passes when its reward is at least this."""
    rewards: list[float] = field(default_factory=list)
    by_prompt: dict[int, list[float]] = field(default_factory=dict)
    failed: dict[str, int] = field(default_factory=dict)
    versions: set[int] = field(default_factory=set)
    started: float = field(default_factory=time.monotonic)

    def trajectory_id(self, i: int) -> str:
        return f"{self._prefix}{i}"

    def owns(self, trajectory_id: str) -> bool:
        return trajectory_id.startswith(self._prefix)

    @property
    def _prefix(self) -> str:
        return f"{EVAL_PREFIX}v{self.version}-{self.nonce}-p"

    @property
    def done(self) -> bool:
        return len(self.rewards) + sum(self.failed.values()) >= self.total

    def record(
        self, reward: float | None, versions: list[int], failure: str = "", trajectory_id: str = ""
    ) -> None:
        if failure:
            self.failed[failure] = self.failed.get(failure, 0) + 1
        elif reward is not None:
            self.rewards.append(reward)
            if trajectory_id:
                prompt = int(trajectory_id[len(self._prefix) :]) // self.samples
                self.by_prompt.setdefault(prompt, []).append(reward)
        self.versions.update(v for v in versions if v >= 0)

    def pass_rates(self) -> dict[str, float | None]:
        """pass@k for each k, averaged over the prompts with at least k completed samples (a
        failed sample is no sample: infrastructure, not the policy); None where none has."""
        out: dict[str, float | None] = {}
        for k in self.ks:
            rates = [
                pass_at_k(len(r), sum(x >= self.threshold for x in r), k)
                for r in self.by_prompt.values()
                if len(r) >= k
            ]
            out[str(k)] = round(statistics.fmean(rates), 4) if rates else None
        return out

    def summary(self, train_step: int) -> dict[str, Any]:
        r = self.rewards
        mean = statistics.fmean(r) if r else math.nan
        half = 1.96 * statistics.stdev(r) / math.sqrt(len(r)) if len(r) > 1 else math.nan
        return {
            "version": self.version,
            "prompts": self.total // self.samples,
            "trajectories": self.total,
            "completed": len(r),
            "failed": dict(sorted(self.failed.items())),
            "reward_mean": round(mean, 4) if r else None,
            "ci95": [round(mean - half, 4), round(mean + half, 4)] if len(r) > 1 else None,
            "solved": sum(1 for x in r if x >= self.threshold),
            "samples_per_prompt": self.samples,
            "pass_at_k": self.pass_rates(),
            "policy_versions": sorted(self.versions),
            "seconds": round(time.monotonic() - self.started, 2),
            "train_step_at_end": train_step,
        }


class Evaluator:
    """Which round is due, and the one running."""

    def __init__(self, ev: EvalConfig, task: TaskConfig, steps: int, done: set[int] | None = None):
        """Evaluates as `ev` says the policy that `task` trains for `steps` steps."""
        self.ev, self.task = ev, task
        self.tasks = eval_tasks(ev, task)
        self.targets = targets(ev.every, steps)
        self.done: set[int] = set(done or ())
        self.running: Round | None = None

    @property
    def temperature(self) -> float:
        return self.ev.temperature or self.task.temperature

    def due(self, trained_version: int) -> int | None:
        """The newest target the trainer has reached that is not evaluated yet (an older one it
        went past while a round ran, or before a restart, is skipped: its policy is gone)."""
        if self.running is not None:
            return None
        reached = [v for v in self.targets if v <= trained_version]
        if not reached or reached[-1] in self.done:
            return None
        return reached[-1]

    def start(self, version: int, nonce: str) -> Round:
        e = self.ev
        self.running = Round(
            version, len(self.tasks) * e.samples, nonce, e.samples, tuple(e.ks), e.pass_threshold
        )
        return self.running

    def finish(self) -> Round:
        assert self.running is not None
        done, self.running = self.running, None
        self.done.add(done.version)
        return done

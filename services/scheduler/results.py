"""What an engine's turn result may say before it touches a trajectory (the driver acts on those
that pass): ids in the vocabulary, log-probabilities, no more tokens than asked, versions the
trainer has made; and the part of a turn an engine handed back, checked the same way and kept."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from services.common.contracts import ev
from services.common.logging import get_logger
from services.scheduler.inflight import Live, PartialTurn
from services.scheduler.roster import Roster
from services.scheduler.trajectory import Generate, check_turn


class TurnResults:
    def __init__(
        self,
        roster: Roster,
        vocab_size: int | None = None,
        newest_version: Callable[[int], Awaitable[int]] | None = None,
    ):
        """`vocab_size` and `newest_version` (the newest weight version the trainer has made, asked
        with the version a result claims) bound what a result may say; `roster` counts an engine's
        invalid ones."""
        self.roster, self.vocab_size, self.newest_version = roster, vocab_size, newest_version
        self.log = get_logger(component="scheduler")
        self.tokens_kept = 0
        """Tokens handed-back turns had made, kept and continued from."""

    async def check(self, live: Live, res: ev.TurnResult, versions: list[int]) -> None:
        """Raises ValueError for a result no engine serving this job's weights could have made:
        ids outside the vocabulary, logprobs that are no log-probabilities, more tokens than the
        turn asked for, or versions the trainer has not made. A push follows the trainer's commit,
        but the scheduler may hear of the commit after the engine's first tokens at it: one
        version beyond the newest known passes (the trainer checks exactly what it trains on)."""
        budget = live.pending_action.max_new_tokens if live.pending_action is not None else None
        await self._sampled(list(res.token_ids), list(res.logprobs), versions, res.temperature, budget)

    async def _sampled(
        self,
        ids: list[int],
        logprobs: list[float],
        versions: list[int],
        temperature: float,
        budget: int | None,
    ) -> None:
        """ValueError unless these are tokens an engine could have sampled for this job (a version
        one beyond the trainer's newest known passes: see `check`)."""
        check_turn(ids, logprobs, versions, temperature, vocab_size=self.vocab_size, max_tokens=budget)
        claimed = max(versions, default=0)
        if self.newest_version is not None and claimed > (newest := await self.newest_version(claimed)) + 1:
            raise ValueError(f"policy version {claimed}: the trainer's newest is {newest}")

    async def alternatives(
        self, live: Live, res: ev.TurnResult
    ) -> list[tuple[list[int], list[float], list[int]]]:
        """The further samples of the turn (TurnResult.alternatives) as (token ids, logprobs,
        versions), checked as the turn is, within the turn's whole budget; ValueError for more
        than were asked for, or one no engine could have made."""
        if len(res.alternatives) > live.alternatives:
            raise ValueError(f"{len(res.alternatives)} alternatives, {live.alternatives} asked for")
        action, kept = live.pending_action, len(live.partial.token_ids) if live.partial is not None else 0
        budget = action.max_new_tokens + kept if action is not None else None
        out = []
        for alt in res.alternatives:
            versions = list(alt.token_versions) or [res.policy_version] * len(alt.token_ids)
            await self._sampled(list(alt.token_ids), list(alt.logprobs), versions, res.temperature, budget)
            out.append((list(alt.token_ids), list(alt.logprobs), versions))
        return out

    async def continued(self, live: Live, action: Generate, res: ev.TurnResult) -> Generate:
        """The rest of a turn an engine handed back with `res.token_ids` generated: its context
        followed by them, the budget less them. Tokens that do not check out are dropped (the
        turn restarts from its own context)."""
        if not res.token_ids:
            return action
        versions = list(res.token_versions) or [res.policy_version] * len(res.token_ids)
        try:
            await self.check(live, res, versions)
        except ValueError as err:
            self.log.warning(
                "handed_back_tokens_malformed", trajectory_id=live.trajectory_id, reason=str(err)
            )
            self.roster.count_invalid(res.engine_id, str(err))
            return action
        if len(res.token_ids) >= action.max_new_tokens:
            return action  # cannot happen (the engine ends a turn at its budget): start it again
        live.partial = live.partial or PartialTurn()
        live.partial.add(res, versions)
        n = len(res.token_ids)
        self.tokens_kept += n
        self.log.info(
            "turn_continued", trajectory_id=live.trajectory_id, kept_tokens=len(live.partial.token_ids)
        )
        return Generate(
            action.context + list(res.token_ids), action.max_new_tokens - n, max(0, action.min_new_tokens - n)
        )

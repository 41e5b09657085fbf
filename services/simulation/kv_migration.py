"""KV migration in the simulator (Seer's divided rollout, arXiv 2511.14617): a running turn moves with
its KV cache to another engine of its bucket, paying the transfer (`CostModel.kv_transfer_s`)
instead of a re-prefill. Used to even out running turns as a step drains, and to take turns off
engines going back to training. It owns the moves' accounting and the turns in transit."""

from __future__ import annotations

from services.policy.consolidation import EngineSlots, consolidation_moves
from services.simulation.engine import Engine, Request
from services.simulation.kernel import Kernel
from services.simulation.state import KV_RESERVE, MOVED


class KvMigration:
    def __init__(self, sim: Kernel):
        self.sim = sim
        self.moves = 0
        self.sent_tokens = 0
        """KV tokens that left an engine with a moved sequence; each arrives (`received_tokens`)
        after the transfer time, whether it is then used or re-prefilled."""
        self.received_tokens = 0
        self.fallbacks = 0
        """Moved sequences whose destination was full or had newer weights on arrival."""
        self.inbound: dict[str, int] = {}
        """Engine -> turns on their way to it."""

    def load(self, e: Engine) -> int:
        """Turns running on the engine and on their way to it."""
        return e.n + self.inbound.get(e.engine_id, 0)

    def consolidate(self) -> None:
        """Even out running turns across each bucket's engines, moving the longest-running ones
        with their KV, where no queued turn would fill the idle engines anyway."""
        sim = self.sim
        for key, pool in sim.by_bucket.items():
            if len(pool) < 2 or sim.router.queued(key):
                continue
            serving = {e.engine_id: e for e in pool if sim.serving(e)}
            slots = [EngineSlots(i, self.load(e), e.max_seqs) for i, e in serving.items()]
            for src_id, dst_id in consolidation_moves(slots):
                src, dst = serving[src_id], serving[dst_id]
                running = sorted(src.running(), key=lambda x: -x[1])
                for req, _ in running:
                    if self.fits(req.traj_id, dst):
                        self.move(req.traj_id, src, dst)
                        break

    def fits(self, tid: str, e: Engine) -> bool:
        tr = self.sim.trajs[tid]
        return e.fits(tr.context + tr.partial, tr.spec.turns[tr.turn].output_tokens + KV_RESERVE) and (
            self.load(e) < e.max_seqs
        )

    def target(self, tid: str, exclude: set[str]) -> Engine | None:
        """The serving engine with the fewest running turns that has room for this one's KV."""
        sim = self.sim
        tr = sim.trajs[tid]
        best = None
        for e in sim.by_bucket.get(sim.key(tr.bucket), []):
            if e.engine_id in exclude or not sim.serving(e):
                continue
            load = self.load(e)
            if (best is None or load < best[0]) and self.fits(tid, e):
                best = (load, e)
        return best[1] if best else None

    def move(self, tid: str, src: Engine, dst: Engine) -> None:
        """Detach a running turn and send its KV to `dst`; it resumes there on arrival."""
        sim = self.sim
        out = src.detach(sim.now, tid)
        if out is None:
            return
        req, done = out
        tr = sim.trajs[tid]
        tr.partial += min(req.tokens - 1, int(done))
        tr.attribute(tr.partial, src.version)
        tokens = tr.context + tr.partial
        tr.engine = None
        self.moves += 1
        self.sent_tokens += tokens
        self.inbound[dst.engine_id] = self.inbound.get(dst.engine_id, 0) + 1
        arrive = sim.now + sim.cm.kv_transfer_s(tokens, min(src.tp, dst.tp))
        sim.push(arrive, MOVED, (tid, dst.engine_id, src.version, tokens))
        if src.n == 0 and src.engine_id in sim.draining:
            sim.load_weights(src)
        sim.wake(src)

    def on_moved(self, payload: tuple[str, str, int, int]) -> None:
        sim = self.sim
        tid, eid, version, tokens = payload
        self.received_tokens += tokens
        self.inbound[eid] -= 1
        tr = sim.trajs.get(tid)
        if tr is None:
            return  # aborted in transit: its group can no longer be trained
        e = sim.engines[eid]
        turn = tr.spec.turns[tr.turn]
        if version != e.version or not sim.serving(e) or not e.fits(tokens, turn.output_tokens - tr.partial):
            self.fallbacks += 1
            sim.start_turn(tid)  # the KV is stale or has no room: re-prefill wherever it goes
            return
        tr.engine = eid
        sim.router.moved(tid, eid)
        req = Request(tid, turn.output_tokens - tr.partial, tokens, acceptance=sim.acceptance(tr, e))
        e.join(req, sim.now, 0, tr.spec.prompt_id)
        sim.wake(e)

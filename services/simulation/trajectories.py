"""The simulator's trajectories from admission to their group's completion: groups admitted under
the staleness bound (by the training side), a turn's end on its engine, a tool's return, and a
trajectory's finish, which completes its group for a training step."""

from __future__ import annotations

from services.policy.staleness import StalenessBound
from services.simulation.engine import Request
from services.simulation.kernel import Kernel
from services.simulation.state import TOOL, Group, Traj


class Trajectories:
    def __init__(self, sim: Kernel):
        self.sim = sim

    def admit(self, n_groups: int) -> None:
        sim = self.sim
        if n_groups > 0:
            sim.log("admit", sim.version, n_groups)
        for _ in range(n_groups):
            gid = sim.admitted_groups
            sim.admitted_groups += 1
            pid = f"p{gid}"
            # Common random numbers: group k is the same draw in every system, whatever the timing.
            specs = sim.wl.group_for(sim.seed, gid, sim.version, pid)
            g = Group(sim.version, len(specs), [])
            sim.groups[gid] = g
            for k, spec in enumerate(specs):
                tid = f"{pid}s{k}"
                bucket = sim.router.admit(tid, pid, sim.now, spec.output_tokens)
                tr = Traj(spec, gid, sim.now, bucket, sim.version, context=spec.prompt_tokens)
                sim.recent.append(tr)
                sim.trajs[tid] = tr
                g.trajs.append(tid)
                sim.start_turn(tid)

    def turn_done(self, req: Request) -> None:
        sim = self.sim
        tr = sim.trajs[req.traj_id]
        turn = tr.spec.turns[tr.turn]
        if tr.engine is not None:
            tr.attribute(turn.output_tokens, sim.engines[tr.engine].version)
        tr.attributed = 0
        tr.tokens += turn.output_tokens
        tr.context += turn.output_tokens
        tr.partial = 0
        if sim.spec is not None:
            sim.siblings.turn_done(sim.groups[tr.group], tr.turn, tr.engine)
        tr.turn += 1
        if turn.tool is None:
            if tr.engine is not None:
                sim.engines[tr.engine].prefix.forget(req.traj_id)
            self.finish(req.traj_id)
            return
        tr.in_tool = True
        sim.push(sim.now + turn.tool.latency_s, TOOL, req.traj_id)

    def on_tool(self, tid: str) -> None:
        sim = self.sim
        tr = sim.trajs.get(tid)
        if tr is None:
            return  # aborted while in its tool: its group can no longer be trained
        tr.in_tool = False
        call = tr.spec.turns[tr.turn - 1].tool
        assert call is not None
        tr.tool_s += call.latency_s
        tr.context += call.payload_tokens
        d = sim.router.on_tool_return(tid, call.signal, tr.tokens, tr.context, sim.now)
        tr.bucket = d.bucket
        sim.start_turn(tid)

    def finish(self, tid: str) -> None:
        sim = self.sim
        tr = sim.trajs.pop(tid)
        sim.log("done", tr.group, tid, tr.oldest_version, len(sim.groups[tr.group].trajs), sim.version)
        sim.router.finish(tid, tr.tokens, sim.now)
        sim.latencies.append(sim.now - tr.admitted)
        sim.waits.append((tr.queue_s, tr.tool_s))
        tr.finished = True
        sim.finished += 1
        g = sim.groups[tr.group]
        g.left -= 1
        g.tokens += tr.spec.context_tokens
        g.max_context = max(g.max_context, tr.spec.context_tokens)
        g.gen_tokens += tr.gen_tokens
        g.version_tokens += tr.version_tokens
        if tr.oldest_version is not None and (
            g.oldest_version is None or tr.oldest_version < g.oldest_version
        ):
            g.oldest_version = tr.oldest_version
        if g.left == 0:
            sim.ready.append(tr.group)
            sim.training.group_complete()

    def abort_hopeless(self, bound: StalenessBound) -> None:
        """Cancel in-flight groups with a token already past the staleness bound: they could never
        be trained, and every system here frees their engine slots (AReaL bounds staleness at
        admission; the rest drop such groups, which is the same once they are replaced). The live
        scheduler aborts them the same way (`doomed_groups`)."""
        sim = self.sim
        ready = set(sim.ready)
        oldest: dict[int, list[int | None]] = {}
        for t in sim.trajs.values():
            oldest.setdefault(t.group, []).append(t.oldest_version)
        doomed = [
            gid
            for gid, g in sim.groups.items()
            if gid not in ready
            and bound.group_is_stale([g.oldest_version, *oldest.get(gid, ())], sim.version)
        ]
        for gid in doomed:
            g = sim.groups.pop(gid)
            sim.dropped_groups += 1
            sim.log("abort", gid, sim.version)
            by_engine: dict[str, set[str]] = {}
            for tid in g.trajs:
                tr = sim.trajs.pop(tid, None)
                if tr is None:
                    continue
                sim.aborted_trajectories += 1
                sim.router.drop(tid)
                if tr.engine is not None:
                    by_engine.setdefault(tr.engine, set()).add(tid)
            for eid, tids in by_engine.items():
                e = sim.engines[eid]
                e.abort(sim.now, tids)
                sim.wake(e)

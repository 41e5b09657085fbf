"""Libra's pure decisions, a library beneath the services and the simulator: the staleness bound
(admission and stale groups), C-MLFQ with its prefix tree, routing and dispatch of turns to
engines, the planner's allocation search and re-fit, the hybrid pool, lending and speculation
width. No I/O and no clock: callers pass `now` in. The service shells and the simulator call the
same code, so the simulator judges what runs."""

"""The simulator's event-driven core, a library beneath the services: engines, the training side,
the fleet, KV migration, the hybrid pool, re-planning and the run loop, on top of
`services/policy` (the decisions the live services make too). `tools/sim` keeps what stands
around it: scenarios, baseline systems, the CLI, sensitivity, frontier and plots. The planner
imports it to simulate its candidate layouts on the live job (`whatif.py`)."""

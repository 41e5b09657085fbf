"""The learning code, a library beneath the services: the GRPO step and its loss, samples from
trajectories, the learner with its checkpoints and weight snapshots, sharded (FSDP) and hybrid
data-parallel training. The trainer service drives it, and a hybrid rollout engine's training side
runs the same step; neither imports the other."""

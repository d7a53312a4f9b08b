"""Online RL (objective=grpo): a step's rollouts from the live policy, their rewards and advantages."""

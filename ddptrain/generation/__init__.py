"""Generation from a model, below the server and the RL rollouts that both use it."""

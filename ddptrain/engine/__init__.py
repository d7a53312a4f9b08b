"""The exact accumulated step: Engine, the objective, lazily-read step stats, the fp16 loss scale."""

"""Entry points outside dvc repro: the llama.cpp peer, Hydra sweeps, load generation, the busy-neighbour test,
machine reports, params.yaml."""

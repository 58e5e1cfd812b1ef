"""Entry points outside dvc repro: the peers (llama.cpp, vLLM, OpenVINO GenAI), Hydra sweeps, load generation,
the busy-neighbour test, machine reports, params.yaml."""

"""The peers `make peer` measures beside the lab (python -m pipeline.tools.peer): llama.cpp's server (llama_cpp),
vLLM's CPU backend (vllm), OpenVINO GenAI in-process (openvino, its driver openvino_driver run in its own
environment), each peer's virtual environment (venvs), the in-process closed loop both sides share (inprocess) and
PEER.md (report)."""

"""The step-time cost model and the simulator driven by it."""

"""The lab's pipeline: DVC stages (pipeline.stages), the libraries they call (workloads, measuring, modeling,
reporting) and entry points outside `dvc repro` (pipeline.tools)."""

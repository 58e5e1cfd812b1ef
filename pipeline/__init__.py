"""One module per DVC stage (python -m pipeline.<stage>), plus the load generator and metrics."""

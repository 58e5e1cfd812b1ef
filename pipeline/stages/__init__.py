"""One module per DVC stage (dvc.yaml): load the config, call the libraries, write the outputs."""

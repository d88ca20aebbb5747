"""The transform pipeline: stages, typed configs, the optimizer, the pipeline cache and its keys."""

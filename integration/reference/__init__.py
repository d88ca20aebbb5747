"""The reference pipeline: model factory, checkpoint, custom ops, reference transforms and the demo."""

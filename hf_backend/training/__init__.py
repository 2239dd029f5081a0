"""What one training step is made of, whatever the strategy: the gradient-accumulation state, precision,
the optimizer and scheduler wrappers, the prepared objects' registry, unwrapping, triggers, memory helpers and
Accelerate's LocalSGD."""

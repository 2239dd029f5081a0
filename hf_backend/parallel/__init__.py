"""The device mesh and what each parallelism uses of it."""

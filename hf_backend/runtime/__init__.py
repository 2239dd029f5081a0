"""The running process: its state (ranks, device, process group), collectives across processes, seeding,
logging, profiling, and Accelerate's own shared states filled with the engine's answers."""

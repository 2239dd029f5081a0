"""What every other room stands on: the one exception type, Accelerate's enums, which process this is before the
process state exists, one-line notes, argument checks, nested tensor structures, the torch window, the
availability guards and the refused names. Imports nothing else of hf_backend."""

"""`hf-backend plan`: what a run will hold per process, worked out before it is launched (memory.py)."""

"""Prints, from rank 0, the launch config the process received (as JSON), without building an Accelerator."""

import json
import os
import sys

from hf_backend.config.environment import read_launch_config

config = read_launch_config()
if os.environ.get("RANK", "0") == "0":
    with open(sys.argv[1], "w") as f:
        json.dump({"config": config.to_dict(), "world": os.environ.get("WORLD_SIZE"),
                   "threads": os.environ.get("OMP_NUM_THREADS")}, f)

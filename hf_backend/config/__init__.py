"""Configuration: what a launcher hands to the processes, and (with the config issue) the config-file
model."""

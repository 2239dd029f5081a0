"""Starting processes from a running interpreter (notebook / debug launchers), what a failed worker leaves for its
launcher, and the hang watch a launcher installs beside the process group."""

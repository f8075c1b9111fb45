"""Sub-commands of the `kvgate` CLI that are not a module of their own."""

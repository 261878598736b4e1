"""Everything on one machine: the demo and the process supervisor tests and SLURM reuse."""

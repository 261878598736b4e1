"""Running the services in one SLURM allocation: node assignment (plan) and launch (launcher)."""

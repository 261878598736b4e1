"""Deployments: local processes, Kubernetes, SLURM."""

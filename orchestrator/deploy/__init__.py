"""Deploying a pipeline: manifest, planner, placement, command lines, Kubernetes, launcher."""

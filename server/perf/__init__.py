"""The performance model: device profiles, Mac catalog, step cost, batch limits."""

"""batchsim: scripts."""

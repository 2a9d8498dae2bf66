"""batchsim: server."""

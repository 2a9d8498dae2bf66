"""batchsim: scheduler."""

"""batchsim: workloads."""

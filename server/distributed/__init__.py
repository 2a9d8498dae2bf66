"""Decode across N ranks over mx.distributed: launch (parent), the plan channel, the sharded
executor on every rank, and the faults (dead rank, different model files, bad hostfile)."""

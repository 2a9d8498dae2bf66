"""Measurements on this device: microbenchmarks, decode benchmark, calibration fit."""

"""This machine: BLAS selection and the environment every result reports."""

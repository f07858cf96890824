"""Training: advantages (with overlong shaping), the loss registry, off-policy corrections, the
learning-rate schedule, the torch learner.

Importing this package loads no torch; the modules that need it import it themselves.
"""

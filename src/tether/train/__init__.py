"""Training: advantages, the loss registry, off-policy corrections, the torch learner.

Importing this package loads no torch; the modules that need it import it themselves.
"""

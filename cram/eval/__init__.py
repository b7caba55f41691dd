"""Evaluation: GLUE for encoders, held-out loss and lm-eval for causal models."""

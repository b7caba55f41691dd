"""Facts about this machine's devices that both the model and the training runtime consult.

The probe is defined in the model's file, which travels beside every checkpoint and so may import nothing of cram.
"""

from cram.models.crammed_bert import cpu_has_bf16_units

__all__ = ["cpu_has_bf16_units"]

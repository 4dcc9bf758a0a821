"""Math shared by the model (models/) and its parallel layers (moe/, ...): the activation
Functions both run. Nothing here imports another mpoverlap package, so every package may
import it without a cycle."""

"""The floor every package may import: the sequence batch, the loss and backend Protocols, the token
layout, the teacher blend, the distillation spec, the LR schedule."""

"""Pure-PyTorch reference backend: the recurrent definition and the chunked form the kernels follow."""
from gdnkit.dispatch import register

from .backend import ReferenceBackend, reference_backward, reference_forward
from .chunked import ChunkTrace, chunked_gdn
from .chunked_backward import ChunkGrads, chunked_gdn_backward
from .recurrent import recurrent_gdn

BACKEND = register(ReferenceBackend())

__all__ = ["BACKEND", "ReferenceBackend", "reference_forward", "reference_backward", "ChunkTrace",
           "chunked_gdn", "ChunkGrads", "chunked_gdn_backward", "recurrent_gdn"]

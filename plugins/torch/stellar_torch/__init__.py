"""Stellar's torch.distributed backend.

    import stellar_torch                      # registers the "stellar" backend
    torch.distributed.init_process_group("stellar", ...)

The backend meets the other ranks through the Store that torch hands it
(torchrun's TCPStore, a FileStore, init_method="tcp://..."), not a rendezvous
of its own. CPU tensors; see docs/torch.md for the operations, dtypes and
environment variables (STELLAR_COLL_SHM, STELLAR_COLL_WAIT, ...).
"""
import torch
import torch.distributed as dist

from . import _C
from ._C import ProcessGroupStellar

__all__ = ["ProcessGroupStellar", "BACKEND"]

BACKEND = "stellar"

# Registering twice (the module imported under two names) would trip torch's
# assertion; once is enough.
if getattr(dist.Backend, BACKEND.upper(), None) is None:
    dist.Backend.register_backend(BACKEND, _C.create)

"""Embeddings copied onto the decoder's GPU beside the model's kernels, on a CUDA stream of their own."""

from __future__ import annotations

import torch

from common.pb import common_pb2
from common.transport.importer import import_embedding


class SideStreamCopier:
    """Copies embeddings to the decoder's GPU on a stream of its own (one copier per fetch thread).

    A CUDA IPC view is copied device to device after the copy stream waits on the producer's event;
    NIXL READs straight into this GPU (VRAM to VRAM from a GPU encoder).
    Rows in host memory (SHM, inline) go through a pinned staging buffer, so the upload is a real
    asynchronous DMA that runs beside the model's kernels instead of a pageable copy. The fetch thread
    waits for its own copy (the engine thread never does), and only then is the image READY: the
    compute stream reads finished rows without any wait of its own.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self._staging = torch.empty(0, dtype=torch.uint8).pin_memory()

    def _stage(self, rows: torch.Tensor) -> torch.Tensor:
        """rows (on the host) in the pinned buffer, same dtype and shape."""
        nbytes = rows.numel() * rows.element_size()
        if self._staging.numel() < nbytes:
            self._staging = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
        staged = self._staging[:nbytes].view(rows.dtype).view(rows.shape)
        staged.copy_(rows)
        return staged

    def copy(self, ref: common_pb2.EmbeddingRef, encoder: str) -> torch.Tensor:
        """The ref's rows in a new tensor on our device, complete when this returns."""
        with torch.cuda.stream(self.stream):
            if ref.WhichOneof("location") == "nixl":  # READ into our GPU: a tensor of our own already
                owned = import_embedding(ref, device=self.device, source=encoder)
            else:
                view = import_embedding(ref, source=encoder)  # an IPC view: the event wait is on this stream
                if view.device.type != "cuda":
                    view = self._stage(view)
                owned = torch.empty(view.shape, dtype=view.dtype, device=self.device)
                owned.copy_(view, non_blocking=True)
        self.stream.synchronize()
        # The model reads these rows on the default stream: tell the allocator, or once the rows are
        # freed their block could go to this stream's next copy while a queued step still reads them.
        owned.record_stream(torch.cuda.default_stream(self.device))
        return owned

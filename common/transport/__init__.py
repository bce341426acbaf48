"""Moving embeddings between processes: an arena exported once, and readers that view slices of it.

Decoder side: `import_embedding(ref, device)`, `readable_transports()`, `can_import(ref)`.
"""

from common.transport.importer import can_import, import_embedding, readable_transports

__all__ = ["can_import", "import_embedding", "readable_transports"]

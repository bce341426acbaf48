"""Shared pieces of mmserve: stubs, hashing, transports, server skeleton, client and CLI."""

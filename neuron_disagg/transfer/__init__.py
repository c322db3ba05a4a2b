"""Threads and I/O under the protocol core: transports, writer and reader threads, side channel."""

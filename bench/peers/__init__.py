"""Head-to-head benchmarks against other servers (issue 35): :mod:`bench.peers.run`."""

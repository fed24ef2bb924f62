"""``sandpool bench``: sandpool's strategies measured beside what users run today.

Modules:

* :mod:`~sandpool.bench.docker`: a Docker daemon of the benchmark's own (Debian's docker.io),
  the baseline a container per rollout is measured on.
"""

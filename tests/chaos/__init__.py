"""Tests of pdcache.chaos: the faults, the schedule, the oracle, the verdict and the soak."""

"""Tests of pdcache.kernels: copy and attention kernels, every backend."""

"""Tests of pdcache.router: policies, sessions, proxying, failover."""

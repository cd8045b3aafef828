"""`pdcache bench chaos`: a fault-injecting soak checked token by token against an oracle."""

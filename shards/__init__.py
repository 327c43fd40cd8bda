"""clonemap shard servers: the 12/CHP server, Binary Star pairs, and the wire codecs."""

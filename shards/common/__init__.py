"""The shared protocol library: what the shard server, the client, the supervisor and the
benchmarks all use. Nothing here imports the server (``clonemap.shards.server``, ``clonemap.shards.pair``,
...), the client or the supervisor.

    proto/      pure wire codecs: 12/CHP (``chp``), the Binary Star state message
                (``bstar``) and its TTL table (``bstar_ttl``)
    mdp/        MDP/0.2 in one home: codec, broker (core and I/O shell), worker, clients
    cluster     the cluster map document; config (validation) and placement (planning a
                config on a host, with hostfacts) that it is built from
    routing     the key -> shard function every process shares
    zio         capped-batch asyncio I/O over ZeroMQ sockets
    errors      the error root and its axes; timing: heartbeat and silence defaults;
    drops       counted, rate-limited drops; ports: free port ranges; children: child
                processes and their output
"""

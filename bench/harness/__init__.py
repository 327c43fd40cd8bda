"""What every benchmark scenario builds on, apart from the scenarios themselves:

    procs       target processes (servers, forwarders) ended by PID, CPU sampling, the
                shared ``main`` of a scenario (parse, run, print, save)
    record      the JSON record each run saves, tables, live progress
    traffic     the writer and subscriber processes (schedules, stamps, gap checks)
    fleet       starting a set of writers and subscribers together and collecting them
    offer       an offer of load, its targets, and one measured window
    ceilings    the same-run ceilings: a bare PUB->SUB and a bare forwarding loop
    forwarder   the bare SUB->dict->PUB forwarding loop (``python -m bench.harness.forwarder``)
"""

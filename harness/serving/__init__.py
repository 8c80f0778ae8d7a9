"""Serving through a real engine, llama.cpp, with one owner: every `llama-server` the project starts, and every
served metric's name, live in this package.

    engine.py       which build serves (scripts/llama_cpp.sh builds it); proof.py proves a build on this CPU
    gguf.py         a target or a draft export converted to GGUF once, stamped and checked before every use
    draft.py        a run's draft as served (ServedDraft): refused up front when the engine cannot serve it
    server.py       one llama-server (LlamaServer) and the Session that binds engine, server records and logs
    timing.py       the target alone timed before and after the drafters (the one bracketed timing)
    compare.py      served against the harness's own decoder, cycle by cycle; the served metrics logged
    break_even.py   the accepted length at which a draft's shape pays for itself on this machine
    parallel.py     many requests through one server's slots: regeneration and Magpie
    magpie.py       instructions written by the target itself
    metrics.py      the served metrics' names
"""

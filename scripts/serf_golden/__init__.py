"""scripts/capture_serf_golden.py's parts, one concern each: ``config`` (ports, keys, the
message-type tables, the kinds the corpus must cover), ``capture`` (the serf agents, tcpdump
and iptables rules of one scripted scenario, all removed again), ``pcap`` (reading the
capture and reassembling TCP streams), ``describe`` (decrypting, decompressing and
summarising each packet), ``corpus`` (choosing examples and writing the corpus, its
manifest and README). Run as a script, scripts/ is on sys.path, so the parts import each
other as ``serf_golden.*``; nothing else imports them.
"""

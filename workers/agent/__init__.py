"""The agent: intake of a queue's runs, one run's life from start to end, stops, recovery after a
restart, what it publishes (registry, tags), its journal, memory limits and secret env.
"""

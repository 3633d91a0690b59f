"""Cluster runs (multi-member runs, all-or-nothing placement): the spec, members' env, placement,
the booking protocol between agents, followers, the lifecycle, and each back end's member start.
"""

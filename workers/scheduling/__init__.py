"""Deciding what runs where, without starting anything: resources and their parsing, queue specs
and presets, request resolution, the capacity ledger, placement, the dispatch cycle, fair share
and preemption. Pure where it can be; imports no back end.
"""

"""Measuring runs: the sampler, per-run summaries and reports, NVML and RAPL readers, idle checks.
"""

"""harness.workloads"""

"""harness.metrics"""

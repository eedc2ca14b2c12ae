"""Replicas behind a router (``cluster.replicas``, ``cluster.router``): each replica a
whole serving stack of its own, stepped in turn on its own clock (harness.cluster.driver)."""

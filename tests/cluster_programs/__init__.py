"""Programs that each start their own multi-node Ray cluster (run by tests/test_clusters.py)."""

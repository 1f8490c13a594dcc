"""Recommendation models and click data: DLRM (`dlrm`), dataset factories for MovieLens 100K,
synthetic Zipf click logs and the Criteo TSV layout (`data`), and a one-process logistic
regression baseline (`reference`)."""

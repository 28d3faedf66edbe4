"""Environments of memory agents: the action grammar, memory policies, HotpotQA (its loader and BM25 retrieval) and
multi-objective tasks."""

"""Environments of memory agents: the action grammar, memory policies, HotpotQA and its offline synthetic world."""

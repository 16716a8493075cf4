"""The RL math: SDE steps with log-probs, advantages, losses, rollouts.

Pure functions over tensors; nothing here starts processes or touches RPC.
"""

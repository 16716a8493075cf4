"""The RL math: SDE steps with log-probs, advantages, losses, rewards, rollouts.

Pure functions over tensors; nothing here starts processes or touches RPC.
"""

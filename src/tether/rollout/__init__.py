"""Generation: sampling, the engine protocol, rollout workers, the weight channel."""

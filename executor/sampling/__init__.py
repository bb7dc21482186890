"""Sampling: the sampler, each request's sampling state, and the step's sampling beside the model runner."""
